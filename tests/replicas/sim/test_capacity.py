"""One simulated replica's capacity at an SLO, measured by replaying a workload in virtual time."""

from __future__ import annotations

import pytest

from tidal.replicas.sim.capacity import (
    CapacityError,
    Slo,
    WorkloadRequest,
    measure_capacity,
    replay,
    synthetic_mix,
)

PRESET = "llama-3.1-70b-fp8-h200-tp4"  # ~10 rps at chat lengths: replays of a few hundred requests
CHAT = [WorkloadRequest(1000, 200)]
SLO = Slo(ttft_p95_s=1.0, tpot_p95_s=0.05)


def test_a_light_load_meets_the_slo_and_an_overload_does_not() -> None:
    light = replay(PRESET, CHAT, 2.0, duration_s=40)
    heavy = replay(PRESET, CHAT, 30.0, duration_s=40)
    assert light.within(SLO) and not heavy.within(SLO)
    # Below capacity the replica keeps up with what arrives; far above it, it cannot
    assert light.throughput_rps == pytest.approx(2.0, rel=0.35)
    assert heavy.throughput_rps < 0.8 * 30.0
    assert light.ttft_p95_s < heavy.ttft_p95_s and light.kv_usage_mean < heavy.kv_usage_mean
    assert light.requests == pytest.approx(2.0 * 20, rel=0.5)  # the middle half of 40 s


def test_the_capacity_is_the_largest_rate_within_the_slo_to_the_tolerance() -> None:
    cap = measure_capacity(PRESET, CHAT, SLO, duration_s=30, rel_tol=0.1, start_rps=4.0)
    assert cap.at_slo.within(SLO) and cap.at_slo.rate_rps == cap.rps_at_slo
    faster = [p for p in cap.points if p.rate_rps > cap.rps_at_slo]
    # The closest rate tried above it misses the SLO, and is within the tolerance
    assert faster and not faster[0].within(SLO)
    assert faster[0].rate_rps <= cap.rps_at_slo * 1.1 + 1e-9
    assert 3.0 < cap.rps_at_slo < 30.0
    # A tighter SLO carries less
    tight = measure_capacity(PRESET, CHAT, Slo(1.0, 0.03), duration_s=30, rel_tol=0.1, start_rps=4.0)
    assert tight.rps_at_slo < cap.rps_at_slo


def test_shared_prefixes_raise_the_capacity() -> None:
    # Every prompt starts with the same 960 tokens (60 blocks of 16): prefill only the rest
    shared = [WorkloadRequest(1000, 50, tuple(range(1, 61)))]
    unique = [WorkloadRequest(1000, 50)]
    a = replay(PRESET, shared, 20.0, duration_s=30)
    b = replay(PRESET, unique, 20.0, duration_s=30)
    assert a.ttft_p95_s < b.ttft_p95_s


def test_an_slo_no_rate_meets_is_an_error_that_says_so() -> None:
    with pytest.raises(CapacityError, match="misses the SLO .* even at"):
        measure_capacity(PRESET, CHAT, Slo(ttft_p95_s=0.001, tpot_p95_s=0.05), duration_s=20)
    with pytest.raises(CapacityError, match="no requests"):
        replay(PRESET, [], 1.0)


def test_a_synthetic_mix_has_its_lengths_in_range_and_refuses_bad_ranges() -> None:
    mix = synthetic_mix(500, prompt_tokens=(100, 4000), output_tokens=(10, 20), seed=3)
    assert len(mix) == 500 and mix == synthetic_mix(
        500, prompt_tokens=(100, 4000), output_tokens=(10, 20), seed=3
    )
    assert all(100 <= w.prompt_tokens <= 4000 and 10 <= w.output_tokens <= 20 for w in mix)
    assert min(w.prompt_tokens for w in mix) < 300 < 2000 < max(w.prompt_tokens for w in mix)
    with pytest.raises(ValueError, match="prompt_tokens"):
        synthetic_mix(prompt_tokens=(10, 5))
