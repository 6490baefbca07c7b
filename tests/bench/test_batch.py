"""The batch benchmark's workload: a trace's lengths when given, synthetic otherwise, said which."""

from __future__ import annotations

from pathlib import Path

import pytest

import tidal.bench.batch as batch_bench


def test_lengths_come_from_a_given_trace_capped_to_the_context(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,5000,20\n"
        "2023-11-16 18:15:47.0000000,100,900\n"
    )
    w = batch_bench.load_workload(50, trace=str(trace), seed=1)
    assert "t.csv" in w.source and len(w.requests) == 50
    assert set(w.requests) <= {(3000, 20), (100, 512)}


def test_without_a_trace_the_workload_is_synthetic_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_bench, "find_trace", lambda name: None)
    w = batch_bench.load_workload(200, trace=None, seed=1)
    assert w.source.startswith("synthetic") and len(w.requests) == 200
    assert all(8 <= p <= 3000 and 1 <= o <= 512 for p, o in w.requests)
    assert w.requests == batch_bench.load_workload(200, trace=None, seed=1).requests  # seeded


def test_prompts_differ_between_runs_so_no_run_warms_the_others_cache() -> None:
    a = batch_bench._body(7, 100, 10, "m", "direct")
    b = batch_bench._body(7, 100, 10, "m", "tidal")
    assert a["prompt"] != b["prompt"] and a["max_tokens"] == 10 and a["ignore_eos"]
