"""The fleet model against the simulator's engine: exact on tiny scenes, close on a workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduler.plan.workloads import write_profile
from tidal.replicas.sim.presets import get_preset
from tidal.replicas.sim.traces import TraceRequest
from tidal.scheduler.plan.model import predict_fleet
from tidal.scheduler.plan.replay import quantile, replay_fleet
from tidal.scheduler.plan.workload import Workload, load_workload


def test_nearest_rank_quantile() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0
    assert quantile(list(map(float, range(1, 101))), 0.95) == 95.0


def test_one_request_alone_takes_its_prefill_then_one_decode_step_per_token() -> None:
    # Given one 4,000-token prompt (no shared prefix) asking for 5 tokens on an idle 8B replica
    preset = get_preset("llama-3.1-8b-h100")
    reqs = (TraceRequest(0.0, 4000, 5, tuple(range(1, 9))), TraceRequest(1000.0, 16, 2, (99,)))
    w = Workload("one", reqs)
    # When the model predicts it
    stats = predict_fleet(preset, w, 1, warmup_fraction=0.0, keep_samples=True)
    # Then its TTFT is one prefill step and each later token one decode step of a batch of one
    cost = preset.cost
    assert stats.ttft_samples[0] == pytest.approx(cost.step_time(4000, 1, 1, 0, 4000 * 4001 // 2))
    decode = [cost.decode_step_time(1, 4000 + i) for i in range(4)]
    assert stats.tpot_samples[0] == pytest.approx(sum(decode) / 4)
    # and the engine replays it the same way
    replayed = replay_fleet(preset, w, 1, warmup_fraction=0.0, keep_samples=True)
    assert replayed.ttft_samples[0] == pytest.approx(stats.ttft_samples[0])
    assert replayed.tpot_samples[0] == pytest.approx(stats.tpot_samples[0])


def test_a_shared_prefix_is_not_computed_twice() -> None:
    preset = get_preset("llama-3.1-8b-h100")
    ids = tuple(range(1, 9))  # 8 blocks of 512 tokens
    w = Workload("two", (TraceRequest(0.0, 4096, 4, ids), TraceRequest(10.0, 4096, 4, ids)))
    stats = predict_fleet(preset, w, 1, warmup_fraction=0.0, keep_samples=True)
    # the second prompt recomputes only its last block (its last token's logits are needed)
    assert stats.prefix_hit_ratio == pytest.approx(4080 / 8192)
    replayed = replay_fleet(preset, w, 1, warmup_fraction=0.0)
    assert replayed.prefix_hit_ratio == stats.prefix_hit_ratio
    assert stats.ttft_samples[1] < stats.ttft_samples[0] / 5


def test_the_model_predicts_a_fleet_within_ten_percent_of_the_replay(tmp_path: Path) -> None:
    # Given a two-feature workload at 30 req/s on 3 replicas of the 8B on H100
    w = load_workload(profile=write_profile(tmp_path)).scaled_to(30.0)
    preset = get_preset("llama-3.1-8b-h100")
    # When the fleet model predicts it and the engine replays it (least-loaded routing both)
    pred = predict_fleet(preset, w, 3, max_num_seqs=64)
    real = replay_fleet(preset, w, 3, max_num_seqs=64)
    # Then the p95s agree within 10% and the prefix reuse within a few points
    assert pred.requests == real.requests > 1500
    assert pred.ttft_p95_s == pytest.approx(real.ttft_p95_s, rel=0.10)
    assert pred.tpot_p95_s == pytest.approx(real.tpot_p95_s, rel=0.10)
    assert pred.prefix_hit_ratio == pytest.approx(real.prefix_hit_ratio, abs=0.03)
