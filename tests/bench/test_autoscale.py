"""The autoscale benchmark's parts: the fleet model, the virtual pool, the week, and the contract."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from tidal.bench.autoscale import (
    DAY,
    WEEK,
    WEEK_START,
    MeasuredReplicaModel,
    ReplicaModel,
    VirtualPool,
    _profile_from_history,
    per_minute_rates,
    run,
    simulate,
    synthetic_week,
    trace_burstiness,
)
from tidal.bench.traces import TraceRequest
from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec
from tidal.replicas.sim.capacity import Slo
from tidal.scheduler.autoscaler import PoolReplicas
from tidal.scheduler.plan.workload import Workload as RequestMix

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


@pytest.fixture(scope="module")
def measured() -> MeasuredReplicaModel:
    chat = RequestMix("chat", tuple(TraceRequest(0.1 * i, 1000, 200, (10_000 + i,)) for i in range(400)))
    return MeasuredReplicaModel.measure(
        "llama-3.1-70b-fp8-h200-tp4", chat, Slo(1.0, 0.05), label="chat", rel_tol=0.1, ladder=(0.3, 0.7, 1.3)
    )


def test_the_measured_replica_meets_the_slo_up_to_its_capacity_and_queues_beyond(
    measured: MeasuredReplicaModel,
) -> None:
    m = measured
    # Its capacity is the simulated replica's, at the SLO; its curve rises towards it
    assert 3.0 < m.capacity_rps < 30.0 and m.saturation >= 1.0
    assert list(m.utilisation) == sorted(m.utilisation) and m.utilisation[-1] <= m.saturation * 1.001
    ttft, tpot, kv = m.at(1.0)
    assert ttft <= 1.0 and tpot <= 0.05 and 0.0 < kv < 1.0
    assert m.at(0.3)[0] <= ttft and m.at(0.3)[2] < kv and "max_num_seqs" in m.preset
    # A pool of 4 within capacity keeps up; at twice the saturated rate, half the requests queue
    calm = m.step(4, arrivals=0.5 * 4 * m.capacity_rps * 5, dt=5, backlog=0, batch_on=False)
    assert calm.backlog == 0 and calm.queue_wait_s == 0 and calm.tpot_p95_s <= 0.05
    over = m.step(4, arrivals=2 * 4 * m.capacity_rps * m.saturation * 5, dt=5, backlog=0, batch_on=False)
    assert over.backlog == pytest.approx(4 * m.capacity_rps * m.saturation * 5)
    assert over.ttft_p95_s > 1.0
    # Lent to batch, the replicas run full: interactive sees the curve at capacity, batch the rest
    lent = m.step(4, arrivals=0.5 * 4 * m.capacity_rps * 5, dt=5, backlog=0, batch_on=True)
    assert lent.tpot_p95_s == pytest.approx(tpot) and lent.kv_usage == pytest.approx(kv)
    assert lent.batch_tokens == pytest.approx(4 * 0.5 * m.capacity_rps * 200 * 5)
    assert "requests/s per replica at TTFT p95 <= 1 s, TPOT p95 <= 50 ms" in m.describe()


def test_trace_burstiness_counts_whole_minutes_only() -> None:
    # 3.5 minutes of a trace: 10, 30 and 20 requests in the whole minutes, 5 in the half one
    times = (
        [6.0 * i for i in range(10)] + [60 + 2.0 * i for i in range(30)] + [120 + 3.0 * i for i in range(20)]
    )
    times += [180 + 6.0 * i for i in range(5)] + [210.0] * 40
    reqs = [TraceRequest(t, 100, 10) for t in times]
    assert list(trace_burstiness(reqs, 60.0)) == pytest.approx([0.5, 1.5, 1.0])
    with pytest.raises(ValueError, match="too few requests"):
        trace_burstiness(reqs[:50], 60.0)


def test_history_is_imported_per_minute_with_its_burstiness() -> None:
    # A flat week at 100 rps whose minutes alternate 0.5x and 1.5x: the profile learns the top
    flat = synthetic_week(start=WEEK_START - WEEK, step_s=60.0, peak_rps=100.0, event=False, spike=False)
    flat.rates[:] = 100.0
    flat.burstiness = np.array([0.5, 1.5])
    rates = per_minute_rates(flat)
    assert [r for _, r in rates[:4]] == [50.0, 150.0, 50.0, 150.0]
    profile = _profile_from_history([flat])
    assert profile.trained_hours == 168 and profile.predict(WEEK_START + 3600) == pytest.approx(150.0)


def write_trace(path: Path, minutes: int = 60, seed: int = 0) -> Path:
    """An Azure-format trace: ~5 requests/s whose minutes alternate quiet and busy."""
    rng = np.random.default_rng(seed)
    t0 = datetime(2023, 11, 16, 18, 0, tzinfo=UTC).timestamp()
    rows = []
    for m in range(minutes):
        n = int(rng.poisson(200 if m % 2 else 400))
        for t in sorted(rng.uniform(0, 60, n)):
            stamp = datetime.fromtimestamp(t0 + 60 * m + t, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
            rows.append(f"{stamp}0,{int(rng.integers(200, 2000))},{int(rng.integers(20, 300))}")
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def test_the_benchmark_writes_the_contract_rows_for_each_trace_and_a_plot(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    measured: MeasuredReplicaModel,
) -> None:
    # Each workload's replica is measured on its own mix; to keep this test short, both get the
    # replica measured above (its measurement is tested there), with the capacity told apart.
    mixes: list[tuple[str, int]] = []

    def measure_replica(
        preset: str, mix: RequestMix, slo: Slo, label: str, quick: bool
    ) -> MeasuredReplicaModel:
        mixes.append((label, len(mix.requests)))
        return dataclasses.replace(measured, workload=label, capacity_rps=measured.capacity_rps * len(mixes))

    monkeypatch.setattr("tidal.bench.autoscale._measure_replica", measure_replica)
    trace = write_trace(tmp_path / "bursty.csv")
    rows = run(quick=True, out_dir=tmp_path, trace=str(trace), days=1.0)
    assert mixes[0][0].startswith("tidal plan's synthetic chat workload")
    assert mixes[1][0] == "bursty's request lengths" and mixes[1][1] > 10_000
    assert [(r["trace"], r["policy"]) for r in rows] == [
        (t, p) for t in ("synthetic", "bursty") for p in ("reactive", "tidal", "reactive:buffered")
    ]
    for r in rows:
        assert {"trace", "policy", "violation_minutes", "gpu_hours", "batch_tokens_in_troughs"} <= set(r)
        assert r["capacity_rps_per_replica"] > 0 and "replayed in virtual time" in r["fleet_model"]
    # Each workload has its own measured replica: the trace's lengths are not the synthetic chat's
    assert rows[0]["capacity_rps_per_replica"] != rows[3]["capacity_rps_per_replica"]
    json.dumps(rows)
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000
    assert (tmp_path / "autoscale-bursty.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "synthetic: tidal vs reactive" in out and "bursty: tidal vs reactive" in out
    assert "minute by minute shaped like bursty (59 minutes, cycled)" in out  # the last is partial
    with pytest.raises(ValueError, match="no such file"):
        run(quick=True, out_dir=tmp_path, trace=str(tmp_path / "missing.csv"))
