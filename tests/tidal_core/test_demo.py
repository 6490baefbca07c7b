"""`tidal demo --quick`: the whole platform plays a day in about a minute and a half, and the
report it writes shows, in a real browser, the gate pausing batch for the spike, the autoscaler
stepping up before the evening ramp, the bad canary rolled back and the overflow, with their
times. The screenshot stays in the test's directory (``TIDAL_TEST_ARTIFACTS=DIR`` copies it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.batch_tier import require_rabbitmq
from tests.services import headless_chromium

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("gate_paused", "gate_resumed", "scaled_up", "canary_rolled_back", "overflowed")


def test_the_quick_demo_shows_every_mechanism_and_its_report_opens_in_a_browser(tmp_path: Path) -> None:
    require_rabbitmq()
    browser = headless_chromium(tmp_path / "chromium-profile")
    out = tmp_path / "demo"
    env = {**os.environ}
    for var in ("TIDAL_DATABASE_URL", "TIDAL_FILES_DIR", "TIDAL_FLEET_CONFIG", "TIDAL_DATA_DIR"):
        env.pop(var, None)
    run = subprocess.run(
        [sys.executable, "-m", "tidal", "demo", "--quick", "--quiet", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "demo.json").read_text())
    kinds = [e["kind"] for e in result["events"]]
    assert set(KINDS) <= set(kinds), json.dumps(result["events"], indent=1)
    assert all({"t_s", "kind", "detail"} <= e.keys() for e in result["events"])
    first = {k: next(e["t_s"] for e in result["events"] if e["kind"] == k) for k in KINDS}
    starts = {p["name"]: p["t_s"] for p in result["phases"]}
    # The autoscaler met the evening ramp ahead of time; batch yielded to the spike
    assert first["scaled_up"] < starts["evening ramp"], (first, starts)
    assert any(e["kind"] == "gate_paused" and e["t_s"] >= starts["spike"] for e in result["events"])
    assert "eval_score" in next(e["detail"] for e in result["events"] if e["kind"] == "canary_rolled_back")
    # The regulated feature never overflowed, though others did
    last = result["samples"][-1]
    assert last["overflowed"] > 0 and last["overflowed_regulated"] == 0
    assert "regulated-chat: 0 overflowed" in run.stdout

    # When an operator opens the report
    url = (out / "report.html").as_uri()
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
    # Then the table says what happened when, and the plots are there
    for kind in KINDS:
        assert f'class="event {kind}"' in dom, kind
    assert dom.count("<svg") >= 8 and dom.count("<polyline") >= 8
    screenshot = tmp_path / "demo-report.png"
    subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=90, check=True)
    assert screenshot.stat().st_size > 50_000
    if artifacts := os.environ.get("TIDAL_TEST_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, Path(artifacts) / "demo-report.png")
