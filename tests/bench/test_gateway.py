"""The gateway overhead benchmark, briefly: real processes, the contract's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gateway import run

pytestmark = pytest.mark.slow


def test_rows_for_each_target_and_concurrency(tmp_path: Path) -> None:
    rows = run(quick=True, out_dir=tmp_path, concurrency="4", seconds="1.5", tokens="8")
    targets = {r["target"] for r in rows}
    assert {"direct", "tidal"} <= targets  # vllm-router too when installed (the bench extra)
    for r in rows:
        assert {"target", "concurrency", "ttft_p50_s", "ttft_p99_s", "tokens_per_s"} <= set(r)
        assert r["concurrency"] == 4 and r["requests"] > 0 and r["tokens_per_s"] > 0
    tidal = next(r for r in rows if r["target"] == "tidal")
    assert tidal["proxy_cpu_s"] > 0 and tidal["ttft_p50_s"] > 0
