"""The workload a plan is made for: a request mix with arrival times, and the load over a week.

A :class:`Workload` holds requests (:class:`~replicas.sim.traces.TraceRequest`: arrival, prompt
and output lengths, chained prefix ids) each tagged with a feature, sorted by arrival. It comes
from a trace (Mooncake JSONL or Azure CSV), from the built-in synthetic workload, or from a
profile file (length distributions per feature and the load by hour of the week)::

    # profile.yaml: every key is optional
    name: support-chat
    duration_s: 3600            # how much traffic to generate for the replays
    rate_rps: 6.0               # its mean rate (the peak hour is rescaled by --peak-rps)
    seed: 0
    shared_prefix_tokens: 1024  # a system prompt every request of a feature starts with
    features:
      chat: {share: 0.8, prompt_tokens: [256, 4096], output_tokens: [32, 600]}
      rag:  {share: 0.2, prompt_tokens: [4096, 60000], output_tokens: [64, 400]}
    weekly_rps: [...]           # 168 values, Monday 00:00 first (or daily_rps: 24 values)

Lengths are log-uniform within each range. ``scaled_to(rps)`` compresses or stretches arrival
times to a mean rate, ``every(k, offset)`` is what one of ``k`` round-robin replicas receives,
``capped`` applies per-feature context caps (the prompt is cut to ``cap - output``; the prefix
ids it keeps are its first ones), and ``split(threshold)`` separates the requests of a
long-context pool.

Example::

    w = load_workload("synthetic")
    w.rate_rps, w.mean_prompt_tokens, w.share_above(32768)
    w.scaled_to(40.0).every(8, 0)        # one replica's stream in a round-robin fleet of 8 at 40 rps
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidal.replicas.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    find_trace,
    load_trace,
    synthetic_workload,
)

__all__ = [
    "DEFAULT_FEATURE",
    "TRACE_NAMES",
    "Workload",
    "WorkloadError",
    "busiest_rate",
    "load_workload",
    "profile_dict",
    "weekly_shape",
]

DEFAULT_FEATURE = "default"
HOURS_PER_WEEK = 168
# Short names for the shared traces (``../shared/traces`` or ``$TIDAL_TRACES_DIR``).
TRACE_NAMES = {
    "mooncake": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}
_MAX_PROFILE_BYTES = 1024 * 1024
_UNIQUE_BASE = 1 << 44  # prefix ids of generated requests that share nothing


class WorkloadError(ValueError):
    """A workload that cannot be used; the message says why."""


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival, each with a feature, and the load over the week (if known)."""

    label: str
    requests: tuple[TraceRequest, ...]
    features: tuple[str, ...] = ()  # one per request; empty: all DEFAULT_FEATURE
    weekly_rps: tuple[float, ...] | None = None  # 168 hourly rates, Monday 00:00 first
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.requests) < 2:
            raise WorkloadError(f"{self.label}: a workload needs at least 2 requests")
        if self.features and len(self.features) != len(self.requests):
            raise WorkloadError("features must give one feature per request")
        if self.weekly_rps is not None and len(self.weekly_rps) != HOURS_PER_WEEK:
            raise WorkloadError(f"weekly_rps must hold {HOURS_PER_WEEK} hourly rates")

    # -- what it is ---------------------------------------------------------------------------

    def feature_of(self, i: int) -> str:
        return self.features[i] if self.features else DEFAULT_FEATURE

    @property
    def feature_names(self) -> list[str]:
        return sorted(set(self.features)) if self.features else [DEFAULT_FEATURE]

    @property
    def duration_s(self) -> float:
        return max(1e-9, self.requests[-1].arrival_s - self.requests[0].arrival_s)

    @property
    def rate_rps(self) -> float:
        """Mean arrival rate (requests per second)."""
        return (len(self.requests) - 1) / self.duration_s

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(r.input_length for r in self.requests) / len(self.requests)

    @property
    def mean_output_tokens(self) -> float:
        return sum(r.output_length for r in self.requests) / len(self.requests)

    @property
    def mean_context_tokens(self) -> float:
        """Tokens a running request holds on average over its life: its prompt and half its output."""
        return self.mean_prompt_tokens + self.mean_output_tokens / 2

    def share_above(self, tokens: int) -> float:
        """The share of requests whose prompt plus output exceeds ``tokens``."""
        return sum(1 for r in self.requests if r.input_length + r.output_length > tokens) / len(self.requests)

    def busiest_rate(self, window_s: float = 300.0) -> float:
        return busiest_rate(self.requests, window_s)

    # -- derived workloads --------------------------------------------------------------------

    def _with(self, pairs: Sequence[tuple[TraceRequest, str]], label: str) -> Workload:
        reqs = tuple(r for r, _ in pairs)
        feats = tuple(f for _, f in pairs) if self.features else ()
        return replace(self, label=label, requests=reqs, features=feats)

    def _pairs(self) -> list[tuple[TraceRequest, str]]:
        return [(r, self.feature_of(i)) for i, r in enumerate(self.requests)]

    def scaled_to(self, rate_rps: float) -> Workload:
        """The same requests with arrival times compressed or stretched to a mean ``rate_rps``."""
        if not rate_rps > 0:
            raise WorkloadError("the rate must be positive")
        k = self.rate_rps / rate_rps
        t0 = self.requests[0].arrival_s
        pairs = [(replace(r, arrival_s=(r.arrival_s - t0) * k), f) for r, f in self._pairs()]
        return self._with(pairs, self.label)

    def every(self, k: int, offset: int = 0) -> Workload:
        """Every ``k``-th request from ``offset``: one replica's share in a round-robin fleet of ``k``."""
        if k <= 1:
            return self
        pairs = self._pairs()[offset % k :: k]
        if len(pairs) < 2:
            raise WorkloadError(f"{self.label}: too few requests for 1 in {k}")
        return self._with(pairs, f"{self.label} (1 in {k})")

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return self._with(self._pairs()[: max(2, n)], self.label)

    def capped(self, caps: Mapping[str, int]) -> Workload:
        """Each feature's requests cut to its context cap (``*`` caps every feature without its own).

        A request above its cap keeps its output (at most half the cap) and the first
        ``cap - output`` tokens of its prompt, as a client that trims retrieved context would.
        """
        if not caps:
            return self
        out: list[tuple[TraceRequest, str]] = []
        for r, f in self._pairs():
            cap = caps.get(f, caps.get("*"))
            if cap is None or r.input_length + r.output_length <= cap:
                out.append((r, f))
                continue
            output = min(r.output_length, max(1, cap // 2))
            prompt = max(1, cap - output)
            keep = -(-prompt // r.block_tokens)
            out.append((replace(r, input_length=prompt, output_length=output, hash_ids=r.hash_ids[:keep]), f))
        label = ", ".join(f"{k}<={v}" for k, v in sorted(caps.items()))
        return self._with(out, f"{self.label} (caps {label})")

    def split(self, threshold: int) -> tuple[Workload | None, Workload | None]:
        """(requests of at most ``threshold`` tokens, the longer ones); ``None`` for an empty side."""
        short = [(r, f) for r, f in self._pairs() if r.input_length + r.output_length <= threshold]
        long = [(r, f) for r, f in self._pairs() if r.input_length + r.output_length > threshold]
        return (
            self._with(short, self.label) if len(short) >= 2 else None,
            self._with(long, f"{self.label} (above {threshold} tokens)") if len(long) >= 2 else None,
        )

    def weekly(self, peak_rps: float) -> list[float]:
        """Requests per second for each hour of the week, the busiest hour at ``peak_rps``."""
        shape = list(self.weekly_rps) if self.weekly_rps is not None else weekly_shape()
        top = max(shape)
        if not top > 0:
            raise WorkloadError("the weekly load is zero everywhere")
        return [peak_rps * v / top for v in shape]


def busiest_rate(requests: Sequence[TraceRequest], window_s: float = 300.0) -> float:
    """Arrivals per second in the busiest ``window_s`` (the whole span when it is shorter)."""
    times = [r.arrival_s for r in requests]
    span = times[-1] - times[0]
    if span <= window_s:
        return (len(times) - 1) / max(span, 1e-9)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best / window_s


def weekly_shape() -> list[float]:
    """A usual week of interactive load (relative, peak 1): a day plateau and an evening peak,
    busier on Friday evening and at the weekend (the shape of ``tidal bench autoscale``'s week)."""

    def bump(h: float, centre: float, width: float) -> float:
        d = abs(h - centre)
        d = min(d, 24.0 - d)
        return math.exp(-((d / width) ** 2))

    out = []
    for hour in range(HOURS_PER_WEEK):
        day, h = divmod(hour, 24)
        hh = h + 0.5  # the middle of the hour
        weekend, friday = day >= 5, day == 4
        v = 0.22 + (0.40 if weekend else 0.30) * bump(hh, 13.0, 3.5)
        v += (0.75 if weekend or friday else 0.65) * bump(hh, 20.75, 1.3)
        out.append(v)
    top = max(out)
    return [v / top for v in out]


# -- profile files ------------------------------------------------------------------------------


class _FeatureMix(BaseModel):
    model_config = ConfigDict(extra="forbid")

    share: float = Field(default=1.0, gt=0)
    prompt_tokens: tuple[int, int] = (256, 4096)
    output_tokens: tuple[int, int] = (32, 600)

    @model_validator(mode="after")
    def _check(self) -> _FeatureMix:
        for name, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi <= 10_000_000:
                raise ValueError(f"{name} must be [low, high] with 1 <= low <= high")
        return self


class _Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="profile", max_length=200)
    duration_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    rate_rps: float = Field(default=5.0, gt=0, le=100_000)
    seed: int = 0
    shared_prefix_tokens: int = Field(default=0, ge=0, le=1_000_000)
    features: dict[str, _FeatureMix] = Field(default_factory=lambda: {DEFAULT_FEATURE: _FeatureMix()})
    weekly_rps: list[float] | None = None
    daily_rps: list[float] | None = None

    @model_validator(mode="after")
    def _check(self) -> _Profile:
        if not self.features:
            raise ValueError("features must name at least one feature")
        if self.weekly_rps is not None and self.daily_rps is not None:
            raise ValueError("give weekly_rps or daily_rps, not both")
        if self.weekly_rps is not None and len(self.weekly_rps) != HOURS_PER_WEEK:
            raise ValueError(f"weekly_rps must hold {HOURS_PER_WEEK} values (Monday 00:00 first)")
        if self.daily_rps is not None and len(self.daily_rps) != 24:
            raise ValueError("daily_rps must hold 24 values")
        for v in (self.weekly_rps or []) + (self.daily_rps or []):
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError("hourly rates must be finite and >= 0")
        if self.duration_s * self.rate_rps > 500_000:
            raise ValueError("duration_s x rate_rps must stay under 500,000 requests")
        return self


def _from_profile(path: Path) -> Workload:
    size = path.stat().st_size
    if size > _MAX_PROFILE_BYTES:
        raise WorkloadError(f"{path}: {size} bytes; a profile is at most {_MAX_PROFILE_BYTES}")
    try:
        raw = (
            yaml.safe_load(path.read_text())
            if path.suffix in (".yaml", ".yml")
            else json.loads(path.read_text())
        )
        prof = _Profile.model_validate(raw or {})
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"{path}: not YAML/JSON: {exc}") from None
    except ValidationError as exc:
        msgs = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'profile'}: {e['msg']}" for e in exc.errors()
        )
        raise WorkloadError(f"{path}: {msgs}") from None
    rng = random.Random(prof.seed)
    names = sorted(prof.features)
    shares = [prof.features[n].share for n in names]
    bt = MOONCAKE_BLOCK_TOKENS
    shared_blocks = -(-prof.shared_prefix_tokens // bt) if prof.shared_prefix_tokens else 0
    # One system prompt per feature: ids 1.. for the first, then the next, and so on.
    prefix_ids = {n: tuple(range(1 + k * 4096, 1 + k * 4096 + shared_blocks)) for k, n in enumerate(names)}

    def log_uniform(lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        return max(lo, min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))

    reqs: list[TraceRequest] = []
    feats: list[str] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(prof.rate_rps)
        if t >= prof.duration_s:
            break
        f = rng.choices(names, shares)[0]
        mix = prof.features[f]
        prompt = log_uniform(mix.prompt_tokens) + prof.shared_prefix_tokens
        output = log_uniform(mix.output_tokens)
        n_blocks = -(-prompt // bt)
        base = _UNIQUE_BASE + i * 65536
        own = tuple(range(base, base + n_blocks - len(prefix_ids[f])))
        reqs.append(TraceRequest(t, prompt, output, prefix_ids[f][:n_blocks] + own))
        feats.append(f)
        i += 1
    weekly: tuple[float, ...] | None = None
    if prof.weekly_rps is not None:
        weekly = tuple(prof.weekly_rps)
    elif prof.daily_rps is not None:
        weekly = tuple(prof.daily_rps) * 7
    if len(reqs) < 2:
        raise WorkloadError(f"{path}: duration_s x rate_rps gives fewer than 2 requests")
    return Workload(f"profile {prof.name} ({path.name})", tuple(reqs), tuple(feats), weekly)


def load_workload(spec: str | Path | None = None, *, profile: Path | None = None, seed: int = 0) -> Workload:
    """The workload ``tidal plan --workload`` names, or the one a ``--profile`` file describes.

    ``spec``: ``synthetic`` (default: the built-in multi-turn chat workload, 10 minutes at 20 rps),
    a short trace name (``mooncake``, ``mooncake-synthetic``, ``azure-conv``, ``azure-code``,
    found under ``../shared/traces`` or ``$TIDAL_TRACES_DIR``), or a trace file path.
    """
    if profile is not None:
        if spec not in (None, "synthetic"):
            raise WorkloadError("give --workload or --profile, not both")
        return _from_profile(Path(profile))
    name = str(spec or "synthetic")
    if name == "synthetic":
        reqs = synthetic_workload(duration_s=600.0, rate_per_s=20.0, seed=seed)
        return Workload(f"built-in synthetic chat workload ({len(reqs)} requests, 10 min)", tuple(reqs))
    if name in TRACE_NAMES:
        found = find_trace(TRACE_NAMES[name])
        if found is None:
            raise WorkloadError(
                f"trace {TRACE_NAMES[name]} not found (../shared/traces or $TIDAL_TRACES_DIR); "
                "pass a file path or use --workload synthetic"
            )
        path = found
    else:
        path = Path(name)
        if not path.is_file():
            known = ", ".join(["synthetic", *TRACE_NAMES])
            raise WorkloadError(f"no workload {name!r}: not a file, nor one of {known}")
    try:
        reqs = load_trace(path, seed=seed)
    except (OSError, ValueError) as exc:
        raise WorkloadError(str(exc)) from None
    reqs = [r for r in reqs if r.input_length >= 1]
    return Workload(f"trace {path.name} ({len(reqs)} requests)", tuple(reqs))


def profile_dict(workload: Workload) -> dict[str, Any]:
    """A short description of the workload for reports."""
    return {
        "label": workload.label,
        "requests": len(workload.requests),
        "rate_rps": round(workload.rate_rps, 3),
        "busiest_5min_rps": round(workload.busiest_rate(), 3),
        "mean_prompt_tokens": round(workload.mean_prompt_tokens, 1),
        "mean_output_tokens": round(workload.mean_output_tokens, 1),
        "features": workload.feature_names,
    }
