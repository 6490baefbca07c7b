"""The routing benchmark on a small trace: the contract's columns, and the policies differ."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tidal.bench.routing import (
    KV_EVENT_LATENCY_S,
    PRESET,
    STORE_RTT_S,
    VirtualClock,
    VirtualGateway,
    VirtualKVEvents,
    VirtualLoadBoard,
    VirtualLoadStore,
    bench_fleet,
    mean_ci95,
    peak_rate,
    replay,
    run,
    settings,
    trace_token_ids,
    variant,
    verdict,
)
from tidal.bench.traces import TraceRequest, block_hashes, synthetic_workload
from tidal.replicas.sim.virtual import SimRequest, VirtualCluster
from tidal.replicas.wire.kv_events import KVCacheEvent
from tidal.router.kv_events import PromptKeys
from tidal.router.loader import build_router

COLUMNS = {
    "trace",
    "load",
    "policy",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "prefix_hit_ratio",
    "ideal_hit_ratio",
    "throughput_tok_s",
    "imbalance",
}


def _mooncake_file(tmp_path: Path) -> Path:
    # Conversations on one shared system block, each with a few turns that extend their prefix.
    lines: list[dict[str, Any]] = []
    t = 0
    for conv in range(40):
        ids = [0, 1000 + conv * 10]
        for turn in range(3):
            ids = [*ids, 100_000 + conv * 10 + turn]
            lines.append(
                {"timestamp": t, "input_length": 512 * len(ids), "output_length": 40, "hash_ids": ids}
            )
            t += 250
    path = tmp_path / "tiny_trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in sorted(lines, key=lambda x: x["timestamp"])) + "\n")
    return path


def _run_tiny(tmp_path: Path, **options: str) -> list[dict[str, Any]]:
    """The quick benchmark on the tiny trace at 50% load (``options`` as on the command line;
    one seed, no tuning, in this process unless they say otherwise)."""
    options = {
        "loads": "0.5",
        "policies": "tidal,round_robin",
        "replicas": "4",
        "seeds": "1",
        "tune": "off",
        "jobs": "1",
        **options,
    }
    return run(quick=True, out_dir=tmp_path, trace=str(_mooncake_file(tmp_path)), **options)


def test_a_trace_file_gives_one_row_per_trace_load_and_policy(tmp_path: Path) -> None:
    rows = _run_tiny(tmp_path)
    assert [(r["load"], r["policy"]) for r in rows] == [(0.5, "tidal"), (0.5, "round_robin")]
    for row in rows:
        assert set(row) >= COLUMNS
        assert row["trace"] == "tiny_trace.jsonl" and row["requests"] == 120
        assert 0 <= row["prefix_hit_ratio"] <= row["ideal_hit_ratio"] + 1e-9
        assert 0 < row["capacity_hit_ratio"] <= row["ideal_hit_ratio"]
        # The tiny trace is shorter than the 5-minute window: peak and mean rate are the same.
        assert row["load_basis"] == "peak" and row["peak_load"] == row["mean_load"] == 0.5
    tidal, rr = rows
    # Turns of a conversation share their prefix: following it beats spreading turns round robin.
    assert tidal["prefix_hit_ratio"] > rr["prefix_hit_ratio"]


def test_replay_uses_the_product_router_and_caps() -> None:
    workload = synthetic_workload(duration_s=120, rate_per_s=2.0, seed=1)
    result = replay(workload, "tidal", scale=1.0, replicas=2)
    assert result["served"] == len(workload) and result["refused"] == 0
    assert all(2 <= c <= 16 for c in result["final_caps"])


def test_peak_rate_is_the_busiest_window() -> None:
    # 10 minutes at 1 request per 10 s, with a burst of 60 more requests in one minute.
    calm = [TraceRequest(float(t), 100, 10) for t in range(0, 600, 10)]
    burst = [TraceRequest(200.0 + i, 100, 10) for i in range(60)]
    workload = sorted(calm + burst, key=lambda r: r.arrival_s)
    assert peak_rate(workload, window_s=300) == (30 + 1 + 60) / 300
    assert peak_rate(workload[:3], window_s=300) == 3 / 20  # shorter than the window: its mean


def test_an_azure_csv_runs_too(tmp_path: Path) -> None:
    rows = [
        f"2023-11-16 18:{m:02d}:{s:02d}.0000000,{1000 + 37 * i},{20 + i % 7}"
        for i, (m, s) in enumerate((m, s) for m in range(10, 14) for s in range(0, 60, 3))
    ]
    path = tmp_path / "azure_tiny.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = run(
        quick=True,
        out_dir=tmp_path,
        trace=str(path),
        loads="0.5",
        policies="tidal",
        replicas="2",
        seeds="1",
        tune="off",
        jobs="1",
    )
    assert len(out) == 1 and out[0]["trace"] == "azure_tiny.csv" and out[0]["requests"] == 80
    # No prefix information: nothing to hit, and no bound says otherwise.
    assert out[0]["ideal_hit_ratio"] == out[0]["capacity_hit_ratio"] == 0.0


def test_each_preset_gets_its_own_rows_and_capacity_bound(tmp_path: Path) -> None:
    rows = _run_tiny(
        tmp_path,
        policies="tidal",
        replicas="2",
        preset="llama-3.1-70b-fp8-h200-tp4,llama-3.1-70b-fp8-h200-tp8",
    )
    assert [r["preset"] for r in rows] == ["llama-3.1-70b-fp8-h200-tp4", "llama-3.1-70b-fp8-h200-tp8"]
    tp4, tp8 = rows
    # TP8 serves the same trace faster, so the same load is a higher request rate.
    assert tp8["capacity_req_s"] > tp4["capacity_req_s"]
    assert tp4["ideal_hit_ratio"] == tp8["ideal_hit_ratio"]


def test_an_unknown_preset_fails_before_any_replay(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown preset"):
        _run_tiny(tmp_path, preset="no-such-gpu")


def test_several_gateways_share_load_and_keep_an_unshared_reference(tmp_path: Path) -> None:
    rows = _run_tiny(tmp_path, gateways="2")
    # One gateway for every policy, two sharing state for every policy, then two that share
    # nothing (the reference) for the cache-aware ones only.
    assert [(r["policy"], r["gateways"], r["sharing"]) for r in rows] == [
        ("tidal", 1, "single"),
        ("round_robin", 1, "single"),
        ("tidal", 2, "shared"),
        ("round_robin", 2, "shared"),
        ("tidal", 2, "unshared"),
    ]
    assert [r["kv_events"] for r in rows] == [True, True, True, True, False]
    one, _, shared, _, unshared = rows
    for two in (shared, unshared):
        assert two["requests"] == one["requests"] == 120 and two["refused"] == 0
        assert 0 < two["prefix_hit_ratio"] <= two["ideal_hit_ratio"] + 1e-9


def _two_gateways() -> tuple[VirtualCluster, VirtualGateway, VirtualGateway, asyncio.AbstractEventLoop]:
    cluster = VirtualCluster(PRESET, 2)
    board = VirtualLoadBoard(VirtualClock(cluster))
    loop = asyncio.new_event_loop()
    fleet = bench_fleet(2)
    a, b = (
        VirtualGateway(cluster, fleet, "tidal", number=i, store=VirtualLoadStore(board, f"gw{i}"), loop=loop)
        for i in range(2)
    )
    return cluster, a, b, loop


def test_a_gateway_sees_anothers_requests_after_the_store_round_trip_not_before() -> None:
    cluster, a, b, loop = _two_gateways()
    assert a.shared is not None and b.shared is not None
    try:
        b.registry.acquire(b.states[0], prompt_tokens=500)
        cluster.run(until=1.0)
        loop.run_until_complete(b.shared.sync_once())  # B publishes at 1.0
        cluster.run(until=1.0 + STORE_RTT_S / 2)
        loop.run_until_complete(a.shared.sync_once())  # too early: still on its way
        assert a.states[0].remote_inflight == 0
        assert a.registry.views("interactive")[0].inflight == 0
        cluster.run(until=1.0 + STORE_RTT_S)
        loop.run_until_complete(a.shared.sync_once())
        assert (a.states[0].remote_inflight, a.states[0].remote_prefill_tokens) == (1, 500)
        view = a.registry.views("interactive")[0]
        assert view.inflight == 1 and view.prefill_tokens == 500
        assert a.registry.free_slots("interactive") == 2 * a.states[0].cap.value - 1
        # B's request ends: A's view empties once B has published that (its peak first, then 0).
        b.registry.release(b.states[0])
        for t in (1.1, 1.2):
            cluster.run(until=t)
            loop.run_until_complete(b.shared.sync_once())
        cluster.run(until=1.2 + STORE_RTT_S)
        loop.run_until_complete(a.shared.sync_once())
        assert a.states[0].remote_inflight == 0
    finally:
        loop.close()


def test_a_gateway_that_stops_publishing_stops_counting_after_the_ttl() -> None:
    cluster, a, b, loop = _two_gateways()
    assert a.shared is not None and b.shared is not None
    try:
        b.registry.acquire(b.states[1])
        loop.run_until_complete(b.shared.sync_once())
        cluster.run(until=0.5)
        loop.run_until_complete(a.shared.sync_once())
        assert a.states[1].remote_inflight == 1
        cluster.run(until=0.5 + a.fleet.gateway.shared_state_ttl_s)
        loop.run_until_complete(a.shared.sync_once())
        assert a.states[1].remote_inflight == 0
    finally:
        loop.close()


def test_every_gateway_follows_the_replicas_kv_events_after_their_latency() -> None:
    cluster = VirtualCluster(PRESET, 2, enable_kv_cache_events=True)
    kv = VirtualKVEvents(cluster)
    req = TraceRequest(
        arrival_s=0.0, input_length=2048, output_length=4, hash_ids=(7, 8, 9, 10), block_tokens=512
    )
    hashes = block_hashes(req, 16)
    done: list[float] = []
    cluster.submit(
        1,
        SimRequest(
            "r", max_tokens=4, block_hashes=hashes, num_prompt_tokens=2048, on_first_token=done.append
        ),
    )
    keys = PromptKeys(lambda: trace_token_ids(hashes, 16, 2048))
    cluster.run(until=0.001)
    assert kv.indexes[1].leading(keys(16)) == 0  # the engine has not cached it yet
    cluster.run()
    assert done
    # Every block the engine can hit (the last token is recomputed) is in replica 1's index only.
    assert kv.indexes[1].leading(keys(16)) == (2048 - 1) // 16
    assert kv.indexes[0].leading(keys(16)) == 0
    # Events reach the index KV_EVENT_LATENCY_S after the step that made them.
    cluster2 = VirtualCluster(PRESET, 1, enable_kv_cache_events=True)
    kv2 = VirtualKVEvents(cluster2)
    sent: list[float] = []
    publish = cluster2.engines[0].on_kv_events
    assert publish is not None

    def spy(events: list[KVCacheEvent]) -> None:
        sent.append(cluster2.now)
        publish(events)

    cluster2.engines[0].on_kv_events = spy
    cluster2.submit(0, SimRequest("r", max_tokens=4, block_hashes=hashes, num_prompt_tokens=2048))
    cluster2.run(until=0.0)
    while not sent:
        cluster2.run(until=cluster2.now + 0.001)
    first = sent[0]
    cluster2.run(until=first + KV_EVENT_LATENCY_S / 2)
    assert len(kv2.indexes[0]) == 0
    cluster2.run(until=first + KV_EVENT_LATENCY_S)
    assert len(kv2.indexes[0]) > 0


def test_every_row_is_a_mean_over_seeds_with_its_interval_and_tidals_verdict(tmp_path: Path) -> None:
    rows = _run_tiny(tmp_path, seeds="3")
    for r in rows:
        assert r["seeds"] == 3 and len(r["ttft_p95_by_seed"]) == 3
        lo, hi = r["ttft_p95_ci95_s"]
        assert lo <= r["ttft_p95_s"] <= hi
        assert r["ttft_p95_s"] == pytest.approx(sum(r["ttft_p95_by_seed"]) / 3)
        lo, hi = r["hit_ratio_ci95"]
        assert lo <= r["prefix_hit_ratio"] <= hi
    tidal, rr = rows
    assert tidal["verdict"] in ("best", "tie", "behind") and "verdict" not in rr
    # The seeds jitter the arrivals: the runs differ.
    assert len(set(rr["ttft_p95_by_seed"])) > 1 or len(set(tidal["ttft_p95_by_seed"])) > 1


def test_a_verdict_of_best_needs_an_interval_below_the_next_policys() -> None:
    assert mean_ci95([1.0, 2.0, 3.0]) == pytest.approx((2.0, 2.0 - 4.303 / 3**0.5, 2.0 + 4.303 / 3**0.5))
    assert mean_ci95([2.5]) == (2.5, 2.5, 2.5)
    assert verdict([1.0, 1.1, 1.05], {"a": [2.0, 2.1, 2.05], "b": [3.0, 3.1, 2.9]}) == "best"
    assert verdict([1.0, 1.1, 1.05], {"a": [0.5, 1.6, 1.05]}) == "tie"  # lower mean, but overlapping
    assert verdict([2.0, 2.1, 2.05], {"a": [1.0, 1.1, 1.05], "b": [3.0, 3.1, 2.9]}) == "behind"


def test_parameters_are_tuned_on_requests_that_are_not_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tidal.bench.routing as routing

    seen: list[tuple[str, dict[str, float], float, frozenset[int]]] = []
    real = routing.replay

    def spy(workload: Any, policy: str, **kw: Any) -> dict[str, Any]:
        ids = frozenset(hash((r.input_length, r.hash_ids)) for r in workload)
        seen.append((policy, dict(kw.get("setting") or {}), kw["scale"], ids))
        return real(workload, policy, **kw)

    monkeypatch.setattr(routing, "replay", spy)
    rows = _run_tiny(tmp_path, tune="on", policies="tidal,sglang_cache_aware,round_robin")
    tuned = {r["policy"]: r["tuned_params"] for r in rows}
    assert tuned["tidal"] in settings("tidal") and tuned["sglang_cache_aware"] in settings(
        "sglang_cache_aware"
    )
    assert tuned["round_robin"] == {} and all(r["tuned_on"] for r in rows)
    # Every grid point of each tunable policy was tried, with the same budget.
    tried = {(p, tuple(sorted(st.items()))) for p, st, _, _ in seen if p != "round_robin"}
    assert len(tried) == len(settings("tidal")) + len(settings("sglang_cache_aware")) == 8
    # The settings not chosen ran only in tuning; round robin (not tuned) only where it is scored.
    tuning = {
        ids for p, st, _, ids in seen if p == "sglang_cache_aware" and st != tuned["sglang_cache_aware"]
    }
    scored = {ids for p, _, scale, ids in seen if p == "round_robin" and scale > 0}
    assert tuning and scored
    for a in scored:
        for b in tuning:
            assert not a & b


def test_a_tuned_setting_reaches_the_router() -> None:
    name, spec = variant("sglang_cache_aware", {"cache-aware-scorer.cache_threshold": 0.5})
    router = build_router(bench_fleet(2, router=spec).router, seed=0)
    ((scorer, _),) = router.profiles[name].scorers
    assert scorer.params.cache_threshold == 0.5
    assert variant("tidal", {}) == ("tidal", None)


def test_llm_d_reads_metrics_every_50_ms_and_tidal_at_the_gateways_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tidal.router.registry import ReplicaRegistry

    calls: list[int] = []
    real = ReplicaRegistry.update_snapshot

    def count(self: ReplicaRegistry, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(ReplicaRegistry, "update_snapshot", count)
    workload = synthetic_workload(duration_s=60, rate_per_s=1.0, seed=3)
    per_policy = {}
    for policy in ("llm_d", "tidal"):
        calls.clear()
        replay(workload, policy, scale=1.0, replicas=2)
        per_policy[policy] = len(calls)
    # 20 x as often while requests are out (both scrape once more when a request finds them idle).
    assert per_policy["llm_d"] > 10 * per_policy["tidal"]


def test_replayed_turns_carry_their_conversations_session() -> None:
    workload = synthetic_workload(duration_s=300, rate_per_s=2.0, seed=1)
    result = replay(workload, "tidal", scale=1.0, replicas=4)
    assert result["session_share"] > 0.3  # later turns of a conversation
    assert result["session_stay"] > 0.8  # and the live profile keeps them where their history is
