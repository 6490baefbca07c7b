"""What one simulated replica carries within a latency SLO, measured by replaying a workload.

:func:`replay` sends a workload's requests to one replica of a :class:`~replicas.sim.virtual.VirtualCluster`
at a given mean rate (Poisson arrivals, the workload's order kept, so shared prefixes stay
near each other) and reports TTFT p95, TPOT p95, KV usage and throughput, in virtual time.
:func:`measure_capacity` finds by bisection the largest rate whose replay keeps both p95s
within the :class:`Slo`: the requests per second one replica serves at the SLO, which is what
the autoscaler divides load by and what ``tidal bench autoscale`` sizes replicas with.

A workload is a sequence of :class:`WorkloadRequest` (prompt and output lengths, and the
prompt's chained block hashes when prefixes are shared); :func:`synthetic_mix` makes one from
length ranges for fleets that have no trace.

Example::

    mix = synthetic_mix(prompt_tokens=(128, 2048), output_tokens=(16, 512))
    cap = measure_capacity("llama-3.1-8b-h100", mix, Slo(ttft_p95_s=1.0, tpot_p95_s=0.05))
    cap.rps_at_slo, cap.at_slo.ttft_p95_s, cap.at_slo.tpot_p95_s
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.replicas.sim.presets import Preset, get_preset
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster

__all__ = [
    "CapacityError",
    "MeasuredCapacity",
    "ReplayPoint",
    "Slo",
    "WorkloadRequest",
    "measure_capacity",
    "replay",
    "synthetic_mix",
]

# Hashes of prompts that share nothing: far above any trace's ids, distinct per request.
_UNIQUE_HASH_BASE = 1 << 52


class CapacityError(ValueError):
    """The replica meets the SLO at no rate tried (or the workload is unusable); the message says why."""


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets a replica must meet: 95th percentiles of TTFT and of time per output token."""

    ttft_p95_s: float = 1.0
    tpot_p95_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.ttft_p95_s > 0 and self.tpot_p95_s > 0):
            raise ValueError("SLO targets must be positive")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: lengths, and the prompt's chained hashes of full blocks of the
    preset's block size when it shares a prefix with others (empty: shares nothing)."""

    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayPoint:
    """One replay of a workload at ``rate_rps`` on one replica: p95s and KV usage of the requests
    that arrived in the middle half of the replay."""

    rate_rps: float
    requests: int
    ttft_p95_s: float
    tpot_p95_s: float
    kv_usage_mean: float
    throughput_rps: float  # completions per second while requests kept arriving
    output_tokens_per_s: float

    def within(self, slo: Slo) -> bool:
        return self.ttft_p95_s <= slo.ttft_p95_s and self.tpot_p95_s <= slo.tpot_p95_s


@dataclass(frozen=True, slots=True)
class MeasuredCapacity:
    """The largest rate found within the SLO (``rps_at_slo``), its replay, every replay tried,
    and how long each replay was (virtual seconds)."""

    preset: str
    slo: Slo
    rps_at_slo: float
    at_slo: ReplayPoint
    points: tuple[ReplayPoint, ...] = field(default=(), repr=False)
    duration_s: float = 120.0


def synthetic_mix(
    n: int = 2000,
    *,
    prompt_tokens: tuple[int, int] = (128, 2048),
    output_tokens: tuple[int, int] = (16, 512),
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``n`` requests with log-uniform prompt and output lengths in the given ranges, no shared prefix."""
    for name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo}..{hi}")
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        return max(lo, min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))

    return [WorkloadRequest(draw(*prompt_tokens), draw(*output_tokens)) for _ in range(max(1, n))]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def replay(
    preset: str | Preset,
    workload: Sequence[WorkloadRequest],
    rate_rps: float,
    *,
    duration_s: float = 120.0,
    seed: int = 0,
) -> ReplayPoint:
    """Replay ``workload`` (cycled) on one replica at ``rate_rps`` with Poisson arrivals for
    ``duration_s`` of virtual time, and measure the requests that arrive in its middle half:
    the first quarter fills the replica up, the last keeps it loaded while they finish."""
    if not workload:
        raise CapacityError("the workload has no requests")
    if not (rate_rps > 0 and duration_s > 0):
        raise ValueError("the rate and the duration must be positive")
    p = preset if isinstance(preset, Preset) else get_preset(preset)
    bs = p.block_size
    max_prompt = max(1, p.context_len - 1)
    rng = random.Random(seed)
    cluster = VirtualCluster(p, 1, seed=seed)
    results: list[SimResult] = []
    start, end = 0.25 * duration_s, 0.75 * duration_s
    t = rng.expovariate(rate_rps)
    i = 0
    while t < duration_s:
        w = workload[i % len(workload)]
        n_prompt = max(1, min(w.prompt_tokens, max_prompt))
        hashes = list(w.block_hashes[: n_prompt // bs])
        if len(hashes) < n_prompt // bs:  # the rest of the prompt is this request's own
            base = _UNIQUE_HASH_BASE + i * (max_prompt // bs + 1)
            hashes += range(base + len(hashes), base + n_prompt // bs)
        req = SimRequest(
            f"r{i}",
            max_tokens=max(1, w.output_tokens),
            block_hashes=hashes,
            num_prompt_tokens=n_prompt,
            on_finish=results.append,
        )

        def arrive(c: VirtualCluster, req: SimRequest = req) -> None:
            c.submit(0, req)

        cluster.at(t, arrive)
        i += 1
        t += rng.expovariate(rate_rps)
    kv: list[float] = []
    samples = 50
    for k in range(samples):

        def sample(c: VirtualCluster) -> None:
            kv.append(c.engines[0].block_pool.get_usage())

        cluster.at(start + (end - start) * k / samples, sample)
    cluster.run()
    measured = [r for r in results if start <= r.arrival < end]
    ttft = [r.ttft for r in measured if r.ttft is not None]
    tpot = [r.tpot for r in measured if r.tpot is not None]
    # Throughput: completions (of any request) from the window's start to the last arrival.
    done = [r for r in results if start <= r.finish_time < duration_s]
    span = duration_s - start
    return ReplayPoint(
        rate_rps=rate_rps,
        requests=len(measured),
        ttft_p95_s=_quantile(ttft, 0.95) if ttft else math.inf,
        tpot_p95_s=_quantile(tpot, 0.95),
        kv_usage_mean=sum(kv) / len(kv) if kv else 0.0,
        throughput_rps=len(done) / span,
        output_tokens_per_s=sum(r.num_output_tokens for r in done) / span,
    )


def measure_capacity(
    preset: str | Preset,
    workload: Sequence[WorkloadRequest],
    slo: Slo | None = None,
    *,
    duration_s: float = 120.0,
    rel_tol: float = 0.02,
    seed: int = 0,
    start_rps: float = 1.0,
) -> MeasuredCapacity:
    """The largest Poisson arrival rate at which one replica keeps TTFT p95 and TPOT p95 within
    ``slo``, to ``rel_tol``: a rate within the SLO is doubled (halved while none is) until one is
    not, then the two are bisected. Every replay uses the same seed, so the arrivals differ only
    in scale. Raises :class:`CapacityError` when even 1/64 of ``start_rps`` misses the SLO."""
    slo = slo or Slo()
    p = preset if isinstance(preset, Preset) else get_preset(preset)
    points: list[ReplayPoint] = []

    def at(rate: float) -> ReplayPoint:
        point = replay(p, workload, rate, duration_s=duration_s, seed=seed)
        points.append(point)
        return point

    lo: ReplayPoint | None = None
    hi: ReplayPoint | None = None
    first = at(start_rps)
    if first.within(slo):
        lo = first
        while hi is None:
            nxt = at(lo.rate_rps * 2)
            if nxt.within(slo):
                lo = nxt
                if lo.rate_rps > 1e6:
                    raise CapacityError(f"{p.name}: no saturation found below {lo.rate_rps:g} rps")
            else:
                hi = nxt
    else:
        hi = first
        while lo is None:
            if hi.rate_rps < start_rps / 64:
                raise CapacityError(
                    f"{p.name} misses the SLO (TTFT p95 <= {slo.ttft_p95_s:g} s, TPOT p95 <= "
                    f"{slo.tpot_p95_s:g} s) even at {hi.rate_rps:.3g} rps: TTFT p95 {hi.ttft_p95_s:.3g} s, "
                    f"TPOT p95 {hi.tpot_p95_s:.3g} s"
                )
            nxt = at(hi.rate_rps / 2)
            if nxt.within(slo):
                lo = nxt
            else:
                hi = nxt
    while (hi.rate_rps - lo.rate_rps) / lo.rate_rps > rel_tol:
        mid = at(math.sqrt(lo.rate_rps * hi.rate_rps))
        if mid.within(slo):
            lo = mid
        else:
            hi = mid
    return MeasuredCapacity(
        p.name, slo, lo.rate_rps, lo, tuple(sorted(points, key=lambda x: x.rate_rps)), duration_s
    )
