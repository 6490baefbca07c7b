"""Workloads for planning: rate scaling, round-robin shares, context caps, profiles, the week."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduler.plan.workloads import write_profile
from tidal.replicas.sim.traces import TraceRequest
from tidal.scheduler.plan.workload import Workload, WorkloadError, load_workload, weekly_shape


def _w(*lengths: tuple[int, int], features: tuple[str, ...] = ()) -> Workload:
    reqs = tuple(
        TraceRequest(float(i), p, o, tuple(range(100 * i, 100 * i + -(-p // 512))))
        for i, (p, o) in enumerate(lengths)
    )
    return Workload("t", reqs, features)


def test_scaling_keeps_the_order_and_reaches_the_rate() -> None:
    w = _w(*[(100, 10)] * 11)
    fast = w.scaled_to(5.0)
    assert fast.rate_rps == pytest.approx(5.0)
    assert [r.input_length for r in fast.requests] == [r.input_length for r in w.requests]
    assert fast.requests[-1].arrival_s == pytest.approx(2.0)


def test_every_kth_request_is_one_replica_of_a_round_robin_fleet() -> None:
    w = _w(*[(100 + i, 10) for i in range(10)])
    assert [r.input_length for r in w.every(3, 1).requests] == [101, 104, 107]
    assert w.every(1) is w


def test_a_context_cap_cuts_the_prompt_of_its_feature_only() -> None:
    w = _w((10_000, 500), (10_000, 500), (100, 10), features=("rag", "chat", "rag"))
    capped = w.capped({"rag": 4096})
    rag, chat, short = capped.requests
    assert (rag.input_length, rag.output_length) == (4096 - 500, 500)
    assert rag.hash_ids == w.requests[0].hash_ids[: -(-3596 // 512)]  # the prefix it keeps is its head
    assert chat.input_length == 10_000  # another feature
    assert short == w.requests[2]  # under the cap
    every = w.capped({"*": 1000})
    assert all(r.input_length + r.output_length <= 1000 for r in every.requests)


def test_split_and_share_above_a_threshold() -> None:
    w = _w((1000, 100), (40_000, 100), (2000, 100), (50_000, 10))
    assert w.share_above(32768) == 0.5
    short, long = w.split(32768)
    assert short is not None and long is not None
    assert [r.input_length for r in long.requests] == [40_000, 50_000]


def test_the_usual_week_peaks_in_the_evening() -> None:
    shape = weekly_shape()
    assert len(shape) == 168 and max(shape) == 1.0
    monday = shape[:24]
    assert monday.index(max(monday)) in (20, 21)
    assert min(shape) > 0.15
    assert _w((1, 1), (1, 1)).weekly(40.0)[20] == pytest.approx(40.0 * shape[20])


def test_a_profile_gives_features_lengths_and_its_week(tmp_path: Path) -> None:
    path = write_profile(tmp_path, daily_rps=[1.0] * 12 + [3.0] * 12)
    w = load_workload(profile=path)
    assert set(w.features) == {"chat", "rag"}
    rag = [r for i, r in enumerate(w.requests) if w.feature_of(i) == "rag"]
    assert all(4096 + 512 <= r.input_length <= 48000 + 512 for r in rag)
    assert 0.08 < len(rag) / len(w.requests) < 0.25
    # every request of a feature starts with its feature's system prompt
    assert len({r.hash_ids[0] for r in rag}) == 1
    assert w.rate_rps == pytest.approx(8.0, rel=0.15)
    assert w.weekly(6.0)[:24] == [2.0] * 12 + [6.0] * 12


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"weekly_rps": [1.0] * 5}, "168 values"),
        ({"features": {"x": {"prompt_tokens": [10, 5]}}}, "low <= high"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_a_bad_profile_names_the_key(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(profile=write_profile(tmp_path, **changes))


def test_a_trace_file_by_path_and_unknown_names(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,44\n2023-11-16 18:15:47.5,396,109\n"
    )
    w = load_workload(str(f))
    assert len(w.requests) == 2 and w.rate_rps == pytest.approx(1 / 1.5)
    with pytest.raises(WorkloadError, match="no workload 'nope'"):
        load_workload("nope")
    with pytest.raises(WorkloadError, match="not both"):
        load_workload("azure-conv", profile=write_profile(tmp_path))


def test_the_built_in_workload_needs_no_trace() -> None:
    w = load_workload("synthetic")
    assert "synthetic" in w.label and w.rate_rps > 10
