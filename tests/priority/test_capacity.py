"""The adaptive per-replica cap: AIMD from measured TPOT, on an injected clock."""

from __future__ import annotations

from tidal.clock import ManualClock
from tidal.priority.capacity import AdaptiveCap


def _cap(clock: ManualClock, initial: int = 64) -> AdaptiveCap:
    return AdaptiveCap(initial, minimum=4, maximum=64, slo_s=0.05, clock=clock, interval_s=2.0, min_samples=8)


def _interval(clock: ManualClock, cap: AdaptiveCap, tpot: float, n: int = 10) -> int:
    clock.advance(2.0)
    for _ in range(n):
        cap.observe(tpot)
    return cap.value


def test_slow_tokens_cut_the_cap_multiplicatively_down_to_the_floor() -> None:
    # Given a replica whose TPOT p95 is 80 ms against a 50 ms SLO,
    # When intervals pass, Then the cap falls 64 -> 48 -> 36 -> 27 ... and stops at the minimum.
    clock = ManualClock()
    cap = _cap(clock)
    seen = [_interval(clock, cap, 0.08) for _ in range(12)]
    assert seen[:4] == [48, 36, 27, 20]
    assert seen[-1] == 4
    assert cap.last_p95 == 0.08


def test_fast_tokens_grow_the_cap_only_while_it_binds() -> None:
    clock = ManualClock()
    cap = _cap(clock, initial=10)
    # Under the SLO but the replica never reached its cap: no reason to grow.
    assert _interval(clock, cap, 0.01) == 10
    # Reaching the cap with fast tokens: +1 per interval.
    cap.note_inflight(10)
    assert _interval(clock, cap, 0.01) == 11
    cap.note_inflight(11)
    assert _interval(clock, cap, 0.01) == 12


def test_no_decision_without_enough_samples_or_before_the_interval() -> None:
    clock = ManualClock()
    cap = _cap(clock)
    for _ in range(20):
        cap.observe(0.5)  # terrible, but the interval has not passed
    assert cap.value == 64
    clock.advance(2.0)
    cap2 = _cap(clock)
    clock.advance(2.0)
    for _ in range(3):
        cap2.observe(0.5)  # too few samples
    assert cap2.value == 64


def test_near_the_slo_the_cap_holds() -> None:
    clock = ManualClock()
    cap = _cap(clock, initial=20)
    cap.note_inflight(20)
    assert _interval(clock, cap, 0.04) == 20  # between 0.65 and 0.85 x SLO
