"""The trace replay of ``tidal bench sim`` on a small synthetic workload."""

from __future__ import annotations

from tidal.bench.sim import _same_results, replay
from tidal.bench.traces import synthetic_workload


def test_replay_in_closed_form_matches_stepping_and_reports_what_happened() -> None:
    reqs = synthetic_workload(duration_s=60, rate_per_s=2.0, seed=5)
    stepped = replay(reqs, preset="llama-3.1-8b-h100", replicas=2, fast_forward=False)
    fast = replay(reqs, preset="llama-3.1-8b-h100", replicas=2, fast_forward=True)
    assert _same_results(stepped.pop("_results"), fast.pop("_results"))
    assert fast["requests"] == stepped["requests"] == len(reqs)
    assert fast["steps"] == stepped["steps"] and fast["events"] < stepped["events"]
    assert 0 < fast["prefix_hit_ratio"] <= fast["ideal_hit_ratio"] + 1e-9
    assert fast["sim_seconds"] >= 60 and fast["sim_seconds_per_wall_second"] > 0
