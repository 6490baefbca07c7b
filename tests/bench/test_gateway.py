"""The gateway overhead benchmark, briefly: real processes, the contract's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.bench.gateway import paired_added, run

pytestmark = pytest.mark.slow


def test_rows_for_each_target_and_concurrency(tmp_path: Path) -> None:
    rows = run(
        quick=True, out_dir=tmp_path, concurrency="4", latency_concurrency="4", seconds="1.5", tokens="8"
    )
    assert {r["mode"] for r in rows} == {"saturated", "latency"}
    for mode in ("saturated", "latency"):
        targets = {r["target"] for r in rows if r["mode"] == mode}
        assert {"direct", "tidal"} <= targets  # vllm-router too when installed (the bench extra)
    for r in rows:
        assert {"target", "concurrency", "ttft_p50_s", "ttft_p99_s", "tokens_per_s"} <= set(r)
        assert {"mode", "added_ttft_p50_s", "tokens_per_cpu_s"} <= set(r)
        assert r["concurrency"] == 4 and r["requests"] > 0 and r["tokens_per_s"] > 0
    for tidal in (r for r in rows if r["target"] == "tidal"):
        assert tidal["proxy_cpu_s"] > 0 and tidal["ttft_p50_s"] > 0 and tidal["tokens_per_cpu_s"] > 0
    # The latency mode's replica is paced (about 10 ms steps): its streams are slower.
    direct = {r["mode"]: r for r in rows if r["target"] == "direct"}
    assert direct["latency"]["tokens_per_s"] < direct["saturated"]["tokens_per_s"]


def test_tidal_with_workers_shares_through_redis_and_reports_staleness(tmp_path: Path) -> None:
    # With no Redis given, the benchmark starts its own redis-server (TIDAL_REDIS_URL unset here).
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TIDAL_REDIS_URL", raising=False)
        rows = run(
            quick=True,
            out_dir=tmp_path,
            mode="saturated",
            concurrency="4",
            seconds="1.5",
            tokens="8",
            workers="2",
        )
    tidal = next(r for r in rows if r["target"] == "tidal")
    assert tidal["workers"] == 2 and tidal["requests"] > 0 and tidal["proxy_cpu_s"] > 0
    assert tidal["shared_state_staleness"].count("worker") == 2


def test_added_ttft_pairs_each_round_with_direct_in_the_same_round() -> None:
    # The machine was slow in round 2 for both: the pairs give +1, +1, +0.5 ms (median +1), where
    # the difference of the medians (2.5 - 2.0) would pair direct's round 3 with the target's.
    direct = [{"ttft_p50_s": x} for x in (1.0, 3.0, 2.0)]
    target = [{"ttft_p50_s": x} for x in (2.0, 4.0, 2.5)]
    assert paired_added(target, direct, "ttft_p50_s") == pytest.approx([1.0, 1.0, 0.5])
