"""What one replica holds and carries: KV tokens, batch sizes, and requests/s at the SLO.

* :func:`kv_tokens` -- tokens of KV one replica holds after weights, activations and reserved
  memory (the simulator's preset arithmetic, as vLLM sizes its cache);
* :func:`largest_batch` -- how many requests of the workload's context mix fit in that KV at once;
* :func:`batch_cap_at_slo` -- the most requests a replica may run at once so that its mean step
  (a decode step of the batch at the mix's context, plus the share of prefill work each output
  token carries) stays within the TPOT target, from the cost model's step time;
* :func:`measure` / :func:`measured_capacity` -- requests/s one replica serves within the SLO,
  **measured** by replaying the workload on the simulated replica in virtual time
  (:func:`replicas.sim.capacity.measure_capacity`: Poisson arrivals, bisection on the rate),
  with the batch cap above. The replica gets every ``k``-th request of the workload, as one of
  ``k`` replicas behind a balancer would, so its prefix-cache hits are those of a fleet of ``k``.

Example::

    slo = Slo(ttft_p95_s=1.0, tpot_p95_s=0.05)
    measured_capacity(preset, workload, slo)           # e.g. 3.3 requests/s per replica
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidal.replicas.sim.capacity import (
    CapacityError,
    MeasuredCapacity,
    Slo,
    WorkloadRequest,
    measure_capacity,
)
from tidal.replicas.sim.presets import Preset
from tidal.replicas.sim.traces import block_hashes
from tidal.scheduler.plan.model import predict_fleet
from tidal.scheduler.plan.workload import Workload

__all__ = [
    "CapacityError",
    "CapacityMeasurement",
    "Slo",
    "batch_cap_at_slo",
    "first_guess",
    "kv_tokens",
    "largest_batch",
    "measure",
    "measured_capacity",
    "uncached_prompt_tokens",
]

# The replays of one measurement should measure at least this many requests (p95s from fewer
# are noise); the replay's middle half is measured.
_MEASURED_REQUESTS = 600


def kv_tokens(preset: Preset) -> int:
    return preset.num_gpu_blocks * preset.block_size


def largest_batch(preset: Preset, workload: Workload) -> int:
    """Requests of the mix's mean context (prompt plus half the output) the KV cache holds at once."""
    return max(1, min(preset.max_num_seqs, int(kv_tokens(preset) // max(1.0, workload.mean_context_tokens))))


def uncached_prompt_tokens(preset: Preset, workload: Workload, fleet_size: int = 1) -> float:
    """Mean prompt tokens a replica computes per request (the rest hit its prefix cache), as the
    fleet model finds for one replica of ``fleet_size`` at the workload's own rate."""
    stream = workload.every(fleet_size) if fleet_size > 1 else workload
    head = stream.head(2000)
    stats = predict_fleet(preset, head, 1, warmup_fraction=0.0)
    return head.mean_prompt_tokens * (1.0 - stats.prefix_hit_ratio)


def batch_cap_at_slo(preset: Preset, workload: Workload, tpot_s: float, *, uncached_tokens: float) -> int:
    """The largest batch whose mean time per output token stays within ``tpot_s``.

    A decode step of ``B`` requests at the mix's mean context takes ``t(B)`` (cost model); each
    request also brings ``uncached_tokens`` of prefill that shares the steps of the ``mean
    output`` tokens it is decoded with, adding ``B x uncached / output x c`` per step, where
    ``c`` is a prefill token's marginal time in a full step. 0 when even one request misses.
    """
    cost = preset.cost
    ctx = workload.mean_context_tokens
    out = max(1.0, workload.mean_output_tokens)
    budget = preset.max_num_batched_tokens
    # Marginal seconds of one prompt token in a step that is otherwise a decode of 1.
    full = cost.step_time(budget, 2, 2, int(ctx), budget * (budget + 1) // 2 + int(ctx))
    per_token = (full - cost.decode_step_time(1, int(ctx))) / (budget - 1)

    def tpot(b: int) -> float:
        return cost.decode_step_time(b, int(b * ctx)) + b * uncached_tokens / out * per_token

    hi = min(preset.max_num_seqs, largest_batch(preset, workload))
    if tpot(1) > tpot_s:
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tpot(mid) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class CapacityMeasurement:
    """A replica's measured capacity and how it was measured."""

    rps: float  # requests/s per replica within the SLO
    batch_cap: int
    fleet_size: int  # the replica got 1 in fleet_size requests of the workload
    measured: MeasuredCapacity
    tokens_per_request: float  # prompt + output tokens of the replayed requests, on average

    @property
    def saturated_tokens_per_s(self) -> float:
        """Prompt + output tokens/s of the busiest replay (what batch work gets from an idle replica)."""
        return max(p.throughput_rps for p in self.measured.points) * self.tokens_per_request


def _requests(preset: Preset, workload: Workload) -> list[WorkloadRequest]:
    bs = preset.block_size
    max_prompt = preset.context_len - 2
    out = []
    for r in workload.requests:
        prompt = min(r.input_length, max_prompt)
        output = max(1, min(r.output_length, preset.context_len - prompt - 1))
        out.append(WorkloadRequest(prompt, output, tuple(block_hashes(r, bs)[: prompt // bs])))
    return out


def first_guess(preset: Preset, workload: Workload, slo: Slo, cap: int) -> float:
    """A starting rate for the bisection: the highest rate, on a doubling/halving ladder, at
    which the fleet model keeps one replica within the SLO."""
    stream = workload.head(1500)
    rate = max(0.05, 0.5 * preset.max_num_batched_tokens / max(1.0, stream.mean_prompt_tokens))

    def ok(r: float) -> bool:
        s = predict_fleet(preset, stream.scaled_to(r), 1, max_num_seqs=cap)
        return s.ttft_p95_s <= slo.ttft_p95_s and s.tpot_p95_s <= slo.tpot_p95_s

    if ok(rate):
        while ok(rate * 2) and rate < 1e5:
            rate *= 2
    else:
        while not ok(rate / 2) and rate > 1e-3:
            rate /= 2
        rate /= 2
    return rate


def measure(
    preset: Preset,
    workload: Workload,
    slo: Slo,
    *,
    fleet_size: int = 1,
    batch_cap: int | None = None,
    rel_tol: float = 0.03,
    min_requests: int = _MEASURED_REQUESTS,
) -> CapacityMeasurement:
    """Measure one replica's requests/s within ``slo`` (see the module docstring).

    Each replay lasts long enough to measure about ``min_requests`` requests at the first rate
    tried. Raises :class:`~replicas.sim.capacity.CapacityError` when the replica misses the SLO
    even at a trickle (e.g. prompts whose prefill alone takes longer than the TTFT target).
    """
    k = max(1, min(fleet_size, len(workload.requests) // 800))
    stream = workload.every(k) if k > 1 else workload
    if batch_cap is None:
        batch_cap = batch_cap_at_slo(
            preset, stream, slo.tpot_p95_s, uncached_tokens=uncached_prompt_tokens(preset, workload, k)
        )
    if batch_cap < 1:
        raise CapacityError(
            f"{preset.name}: even one request at a time takes longer than {slo.tpot_p95_s:g} s per output token"
        )
    capped = replace(preset, max_num_seqs=batch_cap)
    guess = first_guess(capped, stream, slo, batch_cap)
    duration = min(4 * 3600.0, max(30.0, 2 * min_requests / guess))
    measured = measure_capacity(
        capped, _requests(capped, stream), slo, duration_s=duration, rel_tol=rel_tol, start_rps=guess
    )
    tokens = stream.mean_prompt_tokens + stream.mean_output_tokens
    return CapacityMeasurement(measured.rps_at_slo, batch_cap, k, measured, tokens)


def measured_capacity(preset: Preset, workload: Workload, slo: Slo, *, fleet_size: int = 1) -> float:
    """Requests/s one replica of ``preset`` serves within ``slo`` on ``workload`` (measured; see
    :func:`measure`). This is ``requests_per_s_at_slo`` of ``tidal plan``."""
    return measure(preset, workload, slo, fleet_size=fleet_size).rps
