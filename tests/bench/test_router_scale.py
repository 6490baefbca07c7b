"""The router-scale benchmark on tiny pools: one row per pool size and built-in profile, with
the contract's columns and finite, positive timings; a fill stopped by the memory guard says so."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from tidal.bench.router_scale import _fill, _in_child, run
from tidal.bench.routing import bench_fleet
from tidal.clock import ManualClock
from tidal.router.loader import build_router
from tidal.router.plugins.producers.kv_index import KVIndex
from tidal.router.profiles import BUILTIN_PROFILES
from tidal.router.registry import ReplicaRegistry

CONTRACT = {"profile", "replicas", "decision_p50_us", "decision_p99_us", "gc_pause_max_ms"}


def test_every_profile_on_every_pool_size_gives_finite_positive_figures(tmp_path: Path) -> None:
    rows = run(quick=True, out_dir=tmp_path, replicas="8,32", decisions=300, fill=200)
    assert [(r["replicas"], r["profile"]) for r in rows] == [
        (n, p) for n in (8, 32) for p in BUILTIN_PROFILES
    ]
    for r in rows:
        assert set(r) >= CONTRACT | {"decisions", "blocks_per_replica", "gc_collections", "vs_round_robin"}
        assert r["decisions"] == 300 and r["unrouted"] == 0
        assert 0 < r["decision_p50_us"] <= r["decision_p99_us"] <= r["decision_max_us"]
        assert math.isfinite(r["decision_p99_us"]) and math.isfinite(r["vs_round_robin"])
        assert r["vs_round_robin"] > 0 and r["gc_pause_max_ms"] >= 0 and r["gc_full_ms"] > 0
        # Profiles with an index had it filled to what was asked, spread over up to an eighth
        # below it (replicas do not all reach the same growth point together); the others, none.
        if r["indexes"]:
            assert 175 <= r["blocks_min"] <= r["blocks_per_replica"] < 200
        else:
            assert r["blocks_per_replica"] == r["blocks_min"] == 0
        assert r["blocks_target"] > 200  # a replica's KV capacity in 16-token blocks
    assert {r["vs_round_robin"] for r in rows if r["profile"] == "round_robin"} == {1.0}


def test_the_memory_guard_stops_the_fill_and_the_rows_say_how_far_it_got(tmp_path: Path) -> None:
    rows = run(quick=True, out_dir=tmp_path, replicas="8", profiles="tidal", decisions=50, max_rss_gb=0.001)
    # Round robin is always measured: it is the baseline of vs_round_robin.
    assert [r["profile"] for r in rows] == ["tidal", "round_robin"]
    tidal = rows[0]
    assert tidal["blocks_per_replica"] == 0 < tidal["blocks_target"]
    assert tidal["decision_p50_us"] > 0


def test_a_fill_the_memory_guard_stops_leaves_the_replicas_as_spread_as_a_whole_one() -> None:
    # Stopped after equal rounds, every replica held the same count, and all of them reached
    # their dicts' next growth point together during the timed decisions.
    def filled(stop_after: int | None) -> list[int]:
        clock = ManualClock()
        fleet = bench_fleet(64)
        registry = ReplicaRegistry.from_fleet(fleet, clock)
        producers = build_router(fleet.router, clock=clock, seed=1).producers(["tidal"])
        checks = iter(range(10**9))
        rss = lambda: 1 if stop_after is not None and next(checks) >= stop_after else 0  # noqa: E731
        _, _, stopped = _fill(producers, registry, clock, 4_000, 10**6, 1, rss, random.Random(3))
        assert stopped == (stop_after is not None)
        index = next(p for p in producers if isinstance(p, KVIndex))
        return sorted(len(lru) for lru in index._lru.values())

    whole, part = filled(None), filled(8)  # (the guard is read every 64th replica: 8 rounds)
    # A key per 2 blocks: 3,500 to 4,000 blocks, less up to one key per fill call (an odd
    # call's last block leaves none; 16 rounds of at most 256 blocks).
    assert 3_500 // 2 - 16 <= whole[0] < whole[-1] <= 4_000 // 2 and whole[-1] - whole[0] > 300 // 2
    assert 0.4 * whole[-1] < part[-1] < 0.8 * whole[-1]
    assert part[-1] - part[0] > 0.05 * part[-1]


def test_a_run_that_fails_in_its_child_process_fails_the_benchmark() -> None:
    def broken() -> int:
        raise ValueError("no such pool")

    with pytest.raises(RuntimeError, match="no such pool"):
        _in_child(broken)
    assert _in_child(lambda: {"rows": [1, 2]}) == {"rows": [1, 2]}
