"""The batch gate: hysteresis over queue wait p95 and KV usage, hold time, acknowledged pausing.

Scenarios drive a ManualClock; the lane and the load source are in-memory stand-ins (the gate's
logic is what is under test here; the real lane is exercised end to end elsewhere).
"""

from __future__ import annotations

import pytest

from tidal.clock import ManualClock
from tidal.fleet import GateSpec
from tidal.scheduler.gate import BatchGate, GateController, GateSample, GateState, LaneAck
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadReport, PoolLoad

pytestmark = pytest.mark.anyio

SPEC = GateSpec(
    queue_wait_p95_pause_s=0.5,
    queue_wait_p95_resume_s=0.1,
    kv_usage_pause=0.9,
    kv_usage_resume=0.7,
    hold_s=10.0,
    sample_interval_s=0.25,
)
CALM = GateSample(0.0, 0.2)


def open_gate(clock: ManualClock, **kw: float) -> BatchGate:
    return BatchGate("interactive", SPEC, clock=clock, initial=GateState.OPEN, **kw)


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (GateSample(0.5, 0.2), "queue_wait"),
        (GateSample(2.0, 0.2), "queue_wait"),
        (GateSample(0.0, 0.9), "kv_usage"),
        (GateSample(0.7, 0.95), "queue_wait+kv_usage"),
    ],
)
def test_an_open_gate_pauses_on_the_first_sample_over_a_threshold(sample: GateSample, reason: str) -> None:
    # Given an open gate
    clock = ManualClock()
    gate = open_gate(clock)
    # When one sample reaches a pause threshold
    tr = gate.observe(sample)
    # Then it pauses at once, saying why
    assert tr is not None and tr.to is GateState.PAUSED and tr.reason == reason
    assert gate.state is GateState.PAUSED


@pytest.mark.parametrize("sample", [GateSample(0.49, 0.2), GateSample(0.3, 0.89), CALM])
def test_an_open_gate_stays_open_below_the_pause_thresholds(sample: GateSample) -> None:
    gate = open_gate(ManualClock())
    assert gate.observe(sample) is None
    assert gate.state is GateState.OPEN


def test_a_paused_gate_resumes_only_after_both_signals_stay_calm_for_the_hold_time() -> None:
    # Given a gate paused by a queue-wait spike
    clock = ManualClock()
    gate = open_gate(clock)
    gate.observe(GateSample(1.0, 0.5))
    # When the pool is calm from t = 0 to t = 9.75 s, it stays paused
    for _ in range(40):
        assert gate.observe(CALM) is None
        clock.advance(0.25)
    # Then it resumes at t = 10 s, once the hold time has passed since the first calm sample
    tr = gate.observe(CALM)
    assert tr is not None and tr.to is GateState.OPEN and tr.reason == "calm"


def test_hysteresis_a_value_between_the_thresholds_neither_pauses_nor_resumes() -> None:
    # Given a paused gate
    clock = ManualClock()
    gate = open_gate(clock)
    gate.observe(GateSample(0.0, 0.95))
    # When KV usage sits between resume (0.7) and pause (0.9) for a long time
    for _ in range(200):
        clock.advance(0.25)
        assert gate.observe(GateSample(0.0, 0.8)) is None
    # Then it stays paused; and an open gate at the same value stays open
    assert gate.state is GateState.PAUSED
    other = open_gate(clock)
    assert other.observe(GateSample(0.3, 0.8)) is None


def test_one_busy_sample_restarts_the_hold_time() -> None:
    # Given a paused gate that has been calm for 8 s
    clock = ManualClock()
    gate = open_gate(clock)
    gate.observe(GateSample(1.0, 0.2))
    for _ in range(32):
        gate.observe(CALM)
        clock.advance(0.25)
    # When one sample is above a resume threshold (but below the pause one)
    gate.observe(GateSample(0.2, 0.2))
    clock.advance(0.25)
    # Then a full hold time must pass again
    for _ in range(40):
        assert gate.observe(CALM) is None
        clock.advance(0.25)
    assert gate.observe(CALM) is not None


def test_losing_the_signal_pauses_an_open_gate_and_never_resumes_a_paused_one() -> None:
    clock = ManualClock()
    gate = open_gate(clock, signal_timeout_s=1.0)
    gate.observe(CALM)
    # When samples stop coming
    clock.advance(0.75)
    assert gate.observe(None) is None
    clock.advance(0.25)
    tr = gate.observe(None)
    # Then after the signal timeout the gate pauses
    assert tr is not None and tr.reason == "signal_lost"
    # And without samples it never resumes
    for _ in range(100):
        clock.advance(1.0)
        assert gate.observe(None) is None
    assert gate.state is GateState.PAUSED


def test_a_new_gate_starts_paused_until_it_has_seen_calm() -> None:
    clock = ManualClock()
    gate = BatchGate("interactive", SPEC, clock=clock)
    assert gate.state is GateState.PAUSED and gate.reason == "startup"
    gate.observe(CALM)
    clock.advance(10.0)
    assert gate.observe(CALM) is not None
    assert gate.state is GateState.OPEN


def test_re_pausing_soon_after_a_resume_doubles_the_hold_until_the_pool_stays_open() -> None:
    # Given a gate that resumed
    clock = ManualClock()
    gate = open_gate(clock, flap_window_s=30.0, max_hold_s=40.0)
    holds = []
    for _ in range(4):
        # When batch load tips it over again 5 s after each resume
        gate.observe(GateSample(0.0, 0.95))
        holds.append(gate.hold_s)
        gate.observe(CALM)
        clock.advance(gate.hold_s)
        assert gate.observe(CALM) is not None
        clock.advance(5.0)
    # Then each re-pause waits longer, up to the cap
    assert holds == [10.0, 20.0, 40.0, 40.0]
    # And after staying open longer than the flap window, the hold is back to normal
    clock.advance(60.0)
    gate.observe(GateSample(0.0, 0.95))
    assert gate.hold_s == 10.0


def test_resuming_counts_the_kv_share_batch_had_so_its_own_kv_does_not_flap_the_gate() -> None:
    # Given an open gate on a pool at KV 0.65 from users plus 0.25 from lent batch work
    clock = ManualClock()
    gate = open_gate(clock, drain_s=2.0, flap_window_s=0.0)
    tr = gate.observe(GateSample(0.0, 0.9))
    assert tr is not None and tr.reason == "kv_usage"
    # When batch has left (KV back to the users' 0.65) and stays there
    for _ in range(200):
        clock.advance(0.25)
        # Then the gate stays paused: resuming would bring it back to 0.9
        assert gate.observe(GateSample(0.0, 0.65)) is None
        assert gate.observe(GateSample(0.0, 0.61)) is None
    assert gate.batch_kv == pytest.approx(0.25)
    # And it reopens after the hold once users' KV plus batch's share stays clear of the pause
    # line (at or below 0.9 - 0.05)
    for _ in range(40):
        assert gate.observe(GateSample(0.0, 0.55)) is None
        clock.advance(0.25)
    tr = gate.observe(GateSample(0.0, 0.55))
    assert tr is not None and tr.to is GateState.OPEN and "0.25" in tr.detail


def test_the_learned_batch_share_is_capped_so_the_gate_can_always_reopen() -> None:
    clock = ManualClock()
    gate = open_gate(clock, drain_s=1.0, max_batch_kv=0.3)
    gate.observe(GateSample(2.0, 0.95))  # a spike: users' KV falls a lot once it passes
    clock.advance(1.0)
    gate.observe(GateSample(0.0, 0.05))
    assert gate.batch_kv == pytest.approx(0.3)
    clock.advance(SPEC.hold_s)
    assert gate.observe(GateSample(0.0, 0.05)) is not None


# -- the control loop -------------------------------------------------------------------------


class Source:
    def __init__(self) -> None:
        self.pools: dict[str, PoolLoad] = {"interactive": PoolLoad()}
        self.calls = 0
        self.fail = False

    async def load(self) -> LoadReport:
        self.calls += 1
        if self.fail:
            raise ConnectionError("gateway down")
        return LoadReport(time=0.0, pools=dict(self.pools))


class Lane:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail = False
        self.confirm = True

    async def pause(self, pool: str, reason: str) -> LaneAck:
        return self._call("pause", pool, reason)

    async def resume(self, pool: str, reason: str) -> LaneAck:
        return self._call("resume", pool, reason)

    def _call(self, action: str, pool: str, reason: str) -> LaneAck:
        self.calls.append((action, pool, reason))
        if self.fail:
            raise RuntimeError("broker unreachable")
        return LaneAck(confirmed=self.confirm, detail="1 worker", workers=("shared@w1",))


def controller(clock: ManualClock, source: Source, lane: Lane, metrics: SchedulerMetrics) -> GateController:
    gate = BatchGate("interactive", SPEC, clock=clock, initial=GateState.OPEN)
    return GateController([gate], source=source, lane=lane, clock=clock, metrics=metrics)


async def test_the_loop_pauses_the_lane_once_and_counts_the_transition() -> None:
    # Given an open gate whose lane has not been told anything yet
    clock, source, lane, metrics = ManualClock(), Source(), Lane(), SchedulerMetrics()
    ctl = controller(clock, source, lane, metrics)
    await ctl.step()
    assert lane.calls == [("resume", "interactive", "startup")]  # the lane is made to match the gate
    # When the interactive queue wait crosses its threshold
    source.pools["interactive"] = PoolLoad(queue_wait_p95_s=0.8, kv_cache_usage_max=0.3)
    transitions = await ctl.step()
    await ctl.step()
    # Then the lane is paused exactly once, with the reason, and the metrics say so
    assert [t.reason for t in transitions] == ["queue_wait"]
    assert lane.calls[1:] == [("pause", "interactive", "queue_wait")]
    reg = metrics.registry
    labels = {"pool": "interactive", "to": "paused", "reason": "queue_wait"}
    assert reg.get_sample_value("tidal_gate_transitions_total", labels) == 1.0
    assert reg.get_sample_value("tidal_gate_paused", {"pool": "interactive"}) == 1.0
    assert reg.get_sample_value("tidal_gate_queue_wait_p95_seconds", {"pool": "interactive"}) == 0.8
    assert ctl.status()["interactive"]["applied"] == "paused"


async def test_a_failed_or_unconfirmed_pause_is_retried_with_backoff_until_confirmed() -> None:
    # Given a lane that cannot be reached
    clock, source, lane, metrics = ManualClock(), Source(), Lane(), SchedulerMetrics()
    ctl = controller(clock, source, lane, metrics)
    await ctl.step()
    lane.fail = True
    source.pools["interactive"] = PoolLoad(kv_cache_usage_max=0.99)
    # When the gate pauses and the loop keeps sampling every 250 ms for 3 s
    for _ in range(12):
        await ctl.step()
        clock.advance(0.25)
    # Then the pause was retried, but backing off (not on every sample)
    pauses = [c for c in lane.calls if c[0] == "pause"]
    assert 3 <= len(pauses) < 12
    assert ctl.applied["interactive"] is not GateState.PAUSED
    failures = metrics.registry.get_sample_value(
        "tidal_gate_actuation_failures_total", {"pool": "interactive", "action": "pause"}
    )
    assert failures == len(pauses)
    # When the lane answers but does not confirm, it is still not applied
    lane.fail, lane.confirm = False, False
    clock.advance(5.0)
    await ctl.step()
    assert ctl.applied["interactive"] is not GateState.PAUSED
    # When it confirms, the pause is applied and no more calls are made
    lane.confirm = True
    clock.advance(5.0)
    await ctl.step()
    assert ctl.applied["interactive"] is GateState.PAUSED
    n = len(lane.calls)
    await ctl.step()
    assert len(lane.calls) == n


async def test_an_unreadable_source_counts_errors_and_pauses_after_the_signal_timeout() -> None:
    clock, source, lane, metrics = ManualClock(), Source(), Lane(), SchedulerMetrics()
    ctl = controller(clock, source, lane, metrics)
    await ctl.step()
    source.fail = True
    for _ in range(9):
        clock.advance(0.25)
        await ctl.step()
    assert metrics.registry.get_sample_value("tidal_gate_signal_errors_total") == 9.0
    assert ctl.gates["interactive"].state is GateState.PAUSED
    assert ctl.gates["interactive"].reason == "signal_lost"
    assert lane.calls[-1] == ("pause", "interactive", "signal_lost")


async def test_a_pool_missing_from_the_report_counts_as_no_sample() -> None:
    clock, source, lane, metrics = ManualClock(), Source(), Lane(), SchedulerMetrics()
    ctl = controller(clock, source, lane, metrics)
    source.pools = {"other": PoolLoad(queue_wait_p95_s=9.0)}
    await ctl.step()
    assert ctl.gates["interactive"].state is GateState.OPEN
    clock.advance(2.0)
    await ctl.step()
    assert ctl.gates["interactive"].reason == "signal_lost"


async def settle() -> None:
    import asyncio

    for _ in range(50):
        await asyncio.sleep(0)


async def test_the_loop_samples_every_250_ms() -> None:
    import asyncio

    # Given the loop running on a manual clock
    clock, source, lane, metrics = ManualClock(), Source(), Lane(), SchedulerMetrics()
    ctl = controller(clock, source, lane, metrics)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    await settle()
    # When 2 s pass in 250 ms steps
    for _ in range(8):
        clock.advance(0.25)
        await settle()
    # Then it sampled at t = 0, 0.25, ..., 2.0
    assert source.calls == 9
    stop.set()
    clock.advance(0.25)
    await settle()
    await task
    assert ctl.interval_s == 0.25
