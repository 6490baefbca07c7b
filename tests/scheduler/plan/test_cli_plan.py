"""``tidal plan`` on the command line: the --json contract, errors, and the HTML report in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.scheduler.plan.workloads import write_profile
from tests.services import headless_chromium
from tidal.cli import cli

ROOT = Path(__file__).resolve().parents[3]
COMMITTED_SCREENSHOT = ROOT / "docs" / "plan-report.png"


def _plan(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["plan", *args])
    return result.exit_code, result.stdout, result.stderr


def test_json_gives_one_object_with_the_contract(tmp_path: Path) -> None:
    # Given a small profile and the 8B model on H100, one option
    profile = write_profile(tmp_path, duration_s=120)
    html = tmp_path / "plan.html"
    code, out, err = _plan(
        [
            "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1", "--profile", str(profile),
            "--peak-rps", "20", "--kv-dtype", "fp8", "--no-effects", "--quick", "--json", "--html", str(html),
        ]
    )  # fmt: skip
    assert code == 0, err
    # Then stdout is exactly one JSON object; progress went to stderr
    d = json.loads(out)
    assert d["kv_bytes_per_token"] == 65_536  # at the chosen (FP8) KV dtype
    assert d["kv_tokens_in_500_gb"] == 500 * 1024**3 // 65_536
    (o,) = d["options"]
    assert o["tp"] == 1 and o["replicas_per_node"] == 8 and o["kv_dtype"] == "fp8"
    assert o["requests_per_s_at_slo"] > 0 and o["batch_cap_at_slo"] >= 1
    assert o["predicted_ttft_p95_s"] == pytest.approx(o["replay_ttft_p95_s"], rel=0.10)
    assert o["predicted_tpot_p95_s"] == pytest.approx(o["replay_tpot_p95_s"], rel=0.10)
    assert o["cost_per_million_tokens"] > 0 and o["break_even_utilisation"] > 0
    assert "measuring requests/s per replica" in err
    # and the HTML report embeds its plots
    page = html.read_text()
    assert page.count("data:image/png;base64,") >= 4 and "EXAMPLE prices" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-9", "--gpu", "h100"], "unknown model 'gpt-9'"),
        (["--model", "llama-3.1-8b"], "--model and --gpu are required"),
        (["--model", "llama-3.1-8b", "--gpu", "h100", "--context-cap", "rag"], "FEATURE=TOKENS"),
        (["--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "x"], "expected sizes like 4,8"),
        (["--model", "llama-3.1-8b", "--gpu", "h100", "--workload", "nope"], "no workload 'nope'"),
    ],
)
def test_bad_options_say_what_is_wrong(args: list[str], message: str) -> None:
    code, out, err = _plan(args)
    assert code == 2
    assert message in out + err


@pytest.mark.browser
def test_the_html_report_opens_in_a_browser(tmp_path: Path) -> None:
    browser = headless_chromium(tmp_path / "chromium-profile")
    profile = write_profile(tmp_path, duration_s=120)
    html = tmp_path / "plan.html"
    code, _, err = _plan(
        [
            "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1,2", "--profile", str(profile),
            "--peak-rps", "20", "--context-cap", "rag=16384", "--quick", "--html", str(html),
        ]
    )  # fmt: skip
    assert code == 0, err
    url = html.as_uri()
    # When a person opens the report
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
    # Then it shows the options, the week, the capacity replays, prediction against replay, effects
    assert "Capacity plan: llama-3.1-8b on h100" in dom
    for heading in ("Replicas over the week", "Capacity measurement", "Latency distributions", "Effects"):
        assert heading in dom
    assert dom.count("<img") >= 5
    screenshot = tmp_path / "plan-report.png"
    subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=90, check=True)
    assert screenshot.stat().st_size > 50_000
    if os.environ.get("TIDAL_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(screenshot, COMMITTED_SCREENSHOT)


@pytest.mark.slow
def test_the_70b_on_h200_plan_holds_its_prediction_for_tp4_and_tp8() -> None:
    # The check: `tidal plan --model llama-3.1-70b --gpu h200 --json` (what-ifs left out)
    code, out, err = _plan(["--model", "llama-3.1-70b", "--gpu", "h200", "--json", "--no-effects"])
    assert code == 0, err
    d = json.loads(out)
    assert d["kv_bytes_per_token"] == 327_680 and d["kv_bytes_per_token_fp8"] == 163_840
    assert d["kv_tokens_in_500_gb"] == 1_638_400
    assert [o["tp"] for o in d["options"]] == [4, 8]
    for o in d["options"]:
        assert o["predicted_ttft_p95_s"] == pytest.approx(o["replay_ttft_p95_s"], rel=0.10)
        assert o["predicted_tpot_p95_s"] == pytest.approx(o["replay_tpot_p95_s"], rel=0.10)
        assert o["replay_ttft_p95_s"] <= 1.0 and o["replay_tpot_p95_s"] <= 0.05
