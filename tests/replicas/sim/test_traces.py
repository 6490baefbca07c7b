"""Trace loaders, the synthetic workload and the prefix helpers (small generated files only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.replicas.sim.traces import (
    TraceRequest,
    belady_hit_ratio,
    block_hashes,
    capacity_hit_ratio,
    ideal_hit_ratio,
    load_azure,
    load_default,
    load_mooncake,
    prompt_text,
    synthetic_workload,
)


def test_mooncake_lines_and_bucket_jitter(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 3]},
        {"timestamp": 6000, "input_length": 10, "output_length": 1, "hash_ids": [9]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_mooncake(f, seed=1)
    # 3 s buckets are detected and arrivals spread within them, seeded.
    assert all(0 <= r.arrival_s < 9 for r in reqs) and [r.arrival_s for r in reqs] == sorted(
        r.arrival_s for r in reqs
    )
    assert load_mooncake(f, seed=1) == reqs and load_mooncake(f, seed=2) != reqs
    assert [r.arrival_s for r in load_mooncake(f, jitter_s=0)] == [0, 0, 3, 6]
    # Ideal infinite-cache hits: request 2 hits block 0 (512), request 3 hits blocks 0 and 1 (1024).
    assert ideal_hit_ratio(load_mooncake(f, jitter_s=0)) == pytest.approx(
        (512 + 1024) / (1000 + 600 + 1100 + 10)
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_mooncake(bad)


def test_azure_rows_have_relative_arrivals_and_no_shared_prefixes(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n"
    )
    reqs = load_azure(f)
    assert [round(r.arrival_s, 3) for r in reqs] == [0.0, 0.052]
    assert reqs[0].input_length == 4808 and ideal_hit_ratio(reqs) == 0.0


def test_block_hashes_expand_512_token_ids_into_chained_16_token_blocks() -> None:
    a = TraceRequest(0.0, 1000, 5, (7, 8))
    b = TraceRequest(0.0, 700, 5, (7, 9))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 1000 // 16 and len(hb) == 700 // 16
    assert ha[:32] == hb[:32] and ha[32] != hb[32] and len(set(ha)) == len(ha)
    assert len(block_hashes(a, 128)) == 1000 // 128
    with pytest.raises(ValueError):
        block_hashes(a, 96)


def test_synthetic_workload_shares_system_prompts_and_grows_sessions() -> None:
    reqs = synthetic_workload(duration_s=300, seed=3)
    assert reqs and reqs == synthetic_workload(duration_s=300, seed=3)
    assert 0.2 < ideal_hit_ratio(reqs) < 0.95
    sessions: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        assert r.session_id is not None
        sessions.setdefault(r.session_id, []).append(r)
    multi = [s for s in sessions.values() if len(s) > 1]
    assert multi, "some sessions should have several turns"
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids and nxt.turn == prev.turn + 1


def test_prompt_text_is_equal_for_equal_prefixes() -> None:
    a = prompt_text(TraceRequest(0.0, 600, 1, (1, 2)))
    b = prompt_text(TraceRequest(0.0, 600, 1, (1, 3)))
    assert a.split()[:512] == b.split()[:512] and a != b and len(a.split()) == 600


def test_load_default_falls_back_to_the_synthetic_workload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TIDAL_TRACES_DIR", str(tmp_path))
    reqs, source = load_default("no-such-trace.jsonl", synthetic_duration_s=60)
    assert reqs and "synthetic" in source


def _two_conversations() -> tuple[list[TraceRequest], int]:
    """Two conversations on one shared block alternate; each turn repeats its whole history.
    Returns the requests and their prompt tokens."""

    def req(t: float, *ids: int) -> TraceRequest:
        return TraceRequest(t, 512 * len(ids), 1, ids)

    reqs = [req(0, 0, 1), req(1, 0, 2), req(2, 0, 1, 3), req(3, 0, 2, 4)]
    return reqs, 1024 + 1024 + 1536 + 1536


def test_capacity_hit_ratio_is_one_lru_of_the_given_size() -> None:
    reqs, total = _two_conversations()
    # Unbounded, it is the ideal: turn 2 hits [0], turn 3 [0, 1], turn 4 [0, 2].
    assert (
        capacity_hit_ratio(reqs, 10**9) == ideal_hit_ratio(reqs) == pytest.approx((512 + 1024 + 1024) / total)
    )
    # Three blocks: after turn 2 the LRU holds 0, 2, 1 (1 oldest); turn 3 finds 0 and 1, then
    # turn 3 touched 3, 1, 0 and pushed 2 out, so turn 4 finds only the shared block.
    assert capacity_hit_ratio(reqs, 3 * 512) == pytest.approx((512 + 1024 + 512) / total)
    # One block: only the head a turn touched last survives; every turn still shares block 0.
    assert capacity_hit_ratio(reqs, 512) == pytest.approx(3 * 512 / total)


def test_belady_keeps_what_is_used_again_where_lru_keeps_what_is_recent() -> None:
    reqs, total = _two_conversations()
    # Three blocks: turn 3 adds 3 and re-touches 1, neither used again; Belady drops one of them
    # and keeps 2 for turn 4, which LRU pushed out (see the test above).
    assert (
        belady_hit_ratio(reqs, 3 * 512) == ideal_hit_ratio(reqs) == pytest.approx((512 + 1024 + 1024) / total)
    )
    assert belady_hit_ratio(reqs, 3 * 512) > capacity_hit_ratio(reqs, 3 * 512)
    assert belady_hit_ratio(reqs, 10**9) == ideal_hit_ratio(reqs)
    assert belady_hit_ratio(reqs, 512) == pytest.approx(3 * 512 / total)
