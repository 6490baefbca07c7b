"""``tidal sim``'s command line: presets, calibration output, and the server entry point."""

from __future__ import annotations

import json

import httpx
from click.testing import CliRunner

from tidal.cli import cli
from tidal.replicas.launcher import sim_process


def test_list_presets_prints_one_name_a_line() -> None:
    result = CliRunner().invoke(cli, ["sim", "--list-presets"])
    assert result.exit_code == 0
    names = result.output.split()
    assert {
        "tiny-cpu",
        "llama-3.1-70b-fp8-h200-tp4",
        "llama-3.1-70b-fp8-h200-tp8",
        "llama-3.1-70b-bf16-h100-tp4",
        "llama-3.1-8b-h100",
    } <= set(names)
    assert len(names) == len(result.output.strip().splitlines())


def test_calibrate_json_lists_every_point() -> None:
    result = CliRunner().invoke(cli, ["sim", "calibrate", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert rows and all({"point", "published", "simulated", "error_pct"} <= set(r) for r in rows)
    table = CliRunner().invoke(cli, ["sim", "calibrate"])
    assert table.exit_code == 0 and "within 15%" in table.output


def test_unknown_preset_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["sim", "--preset", "nope"])
    assert result.exit_code == 2 and "unknown preset" in result.output


def test_tidal_up_invocation_serves(tmp_path: object) -> None:
    # The command line `tidal up` and the compose file use, with --host.
    proc = sim_process(
        "llama-3.1-8b-h100",
        args=["--served-model-name", "llama-3.1-8b-instruct", "--max-num-seqs", "256", "--host", "127.0.0.1"],
    )
    proc.start()
    try:
        proc.wait_ready(60)
        models = httpx.get(proc.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["llama-3.1-8b-instruct"]
    finally:
        proc.stop()
