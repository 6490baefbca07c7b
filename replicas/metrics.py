"""Parse a vLLM ``/metrics`` page into a typed load snapshot.

Names follow vLLM 0.33 (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits_total``, ...); the
older names (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
``vllm:time_per_output_token_seconds``) are read when the new ones are absent. Values of the same
family are summed across the ``engine`` label (data-parallel ranks).

Example::

    snap = parse_load_snapshot(text)
    snap.num_waiting, snap.kv_cache_usage, snap.prefix_cache_hits
    snap.ttft.quantile(0.95)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "Histogram",
    "LoadSnapshot",
    "Sample",
    "parse_load_snapshot",
    "parse_samples",
]

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _unescape(v: str) -> str:
    return v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def parse_samples(text: str) -> Iterator[Sample]:
    """Yield every sample of a Prometheus text exposition; comments and bad lines are skipped."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        labels: dict[str, str] = {}
        if brace != -1:
            end = line.rfind("}")
            if end < brace:
                continue
            name = line[:brace]
            body = line[brace + 1 : end]
            pos = 0
            while pos < len(body):
                m = _LABEL.match(body, pos)
                if not m:
                    break
                labels[m.group(1)] = _unescape(m.group(2))
                pos = m.end()
            rest = line[end + 1 :].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        yield Sample(name, labels, value)


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` are ``(le, cumulative count)`` ascending."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def quantile(self, q: float) -> float:
        """Estimate the q-quantile by linear interpolation inside the bucket (as PromQL does)."""
        if self.count <= 0 or not self.buckets:
            return math.nan
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def __sub__(self, older: Histogram) -> Histogram:
        """The observations made between ``older`` and this snapshot (same bucket layout)."""
        old = dict(older.buckets)
        return Histogram(
            tuple((le, c - old.get(le, 0.0)) for le, c in self.buckets),
            self.sum - older.sum,
            self.count - older.count,
        )


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What a router or control loop needs to know about one replica at one instant."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    num_preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests_finished: float = 0.0
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None
    ttft: Histogram | None = None
    queue_time: Histogram | None = None
    inter_token_latency: Histogram | None = None
    e2e_latency: Histogram | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    model_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


# Each field: the names to try, newest first. Counters may be exposed with or without `_total`.
_GAUGES = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
_COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "requests_finished": ("vllm:request_success",),
}
_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",),
}


def _split_adapters(v: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in v.split(",")) if a)


def parse_load_snapshot(text: str) -> LoadSnapshot:
    """Parse a ``/metrics`` page (vLLM, the simulated replica, or anything with the same names)."""
    return snapshot_from_samples(parse_samples(text))


def snapshot_from_samples(samples: Iterable[Sample]) -> LoadSnapshot:
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    lora_latest: tuple[float, Sample] | None = None
    models: set[str] = set()
    block_size = num_blocks = None
    for s in samples:
        name = s.name
        if "model_name" in s.labels:
            models.add(s.labels["model_name"])
        if name.endswith("_bucket"):
            le_s = s.labels.get("le")
            if le_s is None:
                continue
            le = math.inf if le_s in ("+Inf", "Inf", "inf") else float(le_s)
            per = buckets.setdefault(name[: -len("_bucket")], {})
            per[le] = per.get(le, 0.0) + s.value
            continue
        if name == "vllm:lora_requests_info":
            if lora_latest is None or s.value >= lora_latest[0]:
                lora_latest = (s.value, s)
            continue
        if name == "vllm:cache_config_info":
            bs, nb = s.labels.get("block_size"), s.labels.get("num_gpu_blocks")
            if bs and bs.isdigit():
                block_size = int(bs)
            if nb and nb.isdigit():
                num_blocks = (num_blocks or 0) + int(nb)
            continue
        if name.endswith("_created"):
            continue
        if name.endswith("_total"):
            name = name[: -len("_total")]
        sums[name] = sums.get(name, 0.0) + s.value

    def first(names: tuple[str, ...]) -> float:
        for n in names:
            if n in sums:
                return sums[n]
        return 0.0

    def hist(names: tuple[str, ...]) -> Histogram | None:
        for n in names:
            if n in buckets:
                b = tuple(sorted(buckets[n].items()))
                return Histogram(b, sums.get(n + "_sum", 0.0), sums.get(n + "_count", b[-1][1] if b else 0.0))
        return None

    kwargs: dict[str, object] = {f: first(n) for f, n in _GAUGES.items()}
    kwargs.update({f: first(n) for f, n in _COUNTERS.items()})
    kwargs.update({f: hist(n) for f, n in _HISTOGRAMS.items()})
    if lora_latest is not None:
        labels = lora_latest[1].labels
        kwargs["running_lora_adapters"] = _split_adapters(labels.get("running_lora_adapters", ""))
        kwargs["waiting_lora_adapters"] = _split_adapters(labels.get("waiting_lora_adapters", ""))
        ml = labels.get("max_lora", "")
        kwargs["max_lora"] = int(ml) if ml.isdigit() else None
    return LoadSnapshot(
        **kwargs,  # type: ignore[arg-type]
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        model_names=frozenset(models),
    )
