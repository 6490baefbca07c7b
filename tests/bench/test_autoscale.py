"""The autoscale benchmark's parts: the fleet model, the virtual pool, the week, and the contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.autoscale import DAY, WEEK_START, ReplicaModel, VirtualPool, run, simulate, synthetic_week
from scheduler.autoscaler import PoolReplicas
from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec

pytestmark = pytest.mark.anyio


def test_the_replica_model_meets_the_target_up_to_capacity_and_queues_beyond_saturation() -> None:
    m = ReplicaModel(capacity_rps=10.0, saturation=1.5)
    calm = m.step(4, arrivals=20 * 5, dt=5, backlog=0, batch_on=False)  # 50% utilisation
    full = m.step(4, arrivals=40 * 5, dt=5, backlog=0, batch_on=False)  # 100%
    over = m.step(4, arrivals=80 * 5, dt=5, backlog=0, batch_on=False)  # 200%: 60 served, 20 queue
    assert calm.ttft_p95_s < m.ttft_target_s and calm.backlog == 0
    assert full.ttft_p95_s == pytest.approx(m.ttft_target_s) and full.backlog == 0
    assert over.backlog == pytest.approx(100) and over.queue_wait_s == pytest.approx(100 / 60)
    assert m.step(0, 10, 5, 0, False).ttft_p95_s == math.inf
    # Batch gets the unused half of each replica, and adds KV usage
    lent = m.step(4, arrivals=20 * 5, dt=5, backlog=0, batch_on=True)
    assert lent.batch_tokens == pytest.approx(4 * 0.5 * m.batch_tokens_per_s * 5)
    assert lent.kv_usage == pytest.approx(calm.kv_usage + m.batch_kv)


async def test_the_virtual_pool_makes_replicas_ready_after_the_cold_start() -> None:
    clock = ManualClock()
    pool = VirtualPool(clock, ready=2, cold_start_s=180)
    await pool.scale("p", 5)
    assert await pool.observe("p", None) == PoolReplicas(2, 3)
    clock.advance(179)
    assert (await pool.observe("p", None)).ready == 2
    clock.advance(1)
    assert await pool.observe("p", None) == PoolReplicas(5, 0)
    await pool.scale("p", 7)
    await pool.scale("p", 4)  # cancels the cold starts first, then stops a ready one
    assert await pool.observe("p", None) == PoolReplicas(4, 0)


def test_the_week_has_its_event_and_spike_where_announced() -> None:
    w = synthetic_week(step_s=60.0)
    assert len(w.rates) == 7 * 1440
    (ev,) = w.events
    assert (ev.start - WEEK_START) / DAY == pytest.approx(5 + 14 / 24)
    (sp,) = w.spikes
    assert (sp[0] - WEEK_START) / DAY == pytest.approx(2 + 11 / 24)
    i_ev = int((ev.start - WEEK_START) / 60) + 30
    usual = synthetic_week(step_s=60.0, event=False, spike=False)
    assert w.rates[i_ev] == pytest.approx(2.2 * usual.rates[i_ev])
    assert not usual.events and not usual.spikes
    # Evening peaks stand above the night
    assert usual.rates[int(20.75 * 60)] > 3 * usual.rates[int(4 * 60)]


def test_on_a_day_with_an_evening_ramp_the_tidal_policy_beats_reactive_only() -> None:
    spec = AutoscalerSpec(
        min_replicas=2,
        max_replicas=100,
        capacity_rps_per_replica=8,
        cold_start_s=180,
        scale_down_stabilisation_s=900,
    )
    history = [synthetic_week(start=WEEK_START - 7 * DAY, step_s=60.0, event=False, spike=False, seed=5)]
    day = synthetic_week(start=WEEK_START, days=1.0, step_s=10.0, seed=6)
    model = ReplicaModel()
    reactive = simulate("reactive", day, model, spec, history=history, warmup_s=3600)
    tidal = simulate("tidal", day, model, spec, history=history, warmup_s=3600)
    assert tidal.violation_minutes < reactive.violation_minutes / 4
    assert tidal.gpu_hours > reactive.gpu_hours  # the buffer is not free
    assert reactive.minutes["t"][0] == 0.0 and len(reactive.minutes["t"]) == 23 * 60


def test_the_benchmark_writes_the_contract_rows_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = run(quick=True, out_dir=tmp_path)
    policies = [r["policy"] for r in rows]
    assert policies[:2] == ["reactive", "tidal"]
    for r in rows:
        assert {"violation_minutes", "gpu_hours", "batch_tokens_in_troughs"} <= set(r)
    json.dumps(rows)
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "workload: synthetic week" in out and "tidal vs reactive" in out
    with pytest.raises(ValueError, match="--bogus"):
        run(quick=True, out_dir=tmp_path, bogus="1")
