"""Read a vLLM ``/metrics`` page as a typed load snapshot.

Names follow vLLM 0.33 (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits_total``, ...); the
older names (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
``vllm:time_per_output_token_seconds``) are read when the new ones are absent. The Prometheus
text itself is read by :mod:`replicas.wire.prom`.

A data-parallel vLLM labels each engine's series with ``engine="N"``; they combine as vLLM means
them: ratio gauges (KV-cache usage) average over engines, request counts and counters add up,
histograms add bucket by bucket, and ``num_gpu_blocks`` adds up across engines.

Example::

    snap = parse_load_snapshot(text)
    snap.num_waiting, snap.kv_cache_usage, snap.prefix_cache_hits
    snap.ttft.quantile(0.95)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.replicas.wire.prom import Histogram, Sample, parse_samples, sum_histograms

__all__ = ["LoadSnapshot", "parse_load_snapshot"]


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


# Each field: the names to try, newest first; how the ``engine`` series of a data-parallel vLLM
# combine is in the name of the table. Counters may be exposed with or without ``_total``.
#
# KV-cache usage is a fraction of one engine's cache, so the replica's is the engines' mean, not
# their sum (0.6 and 0.6 are 0.6, not 1.2). The engines of one vLLM have the same cache size, so
# the mean is the used share of all the replica's blocks; and vLLM's API server sends each new
# request to its least loaded engine, so one full engine does not make the replica full. The max
# would be the cautious reading, but it would shut the batch gate and rank the replica last while
# half its cache is free.
_MEAN: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
}
_SUM: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "requests_finished": ("vllm:request_success",),
}
_HISTOGRAMS: dict[str, tuple[str, ...]] = {  # summed bucket by bucket
    "ttft": ("vllm:time_to_first_token_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",),
}

_HISTOGRAM_NAMES = frozenset(n for names in _HISTOGRAMS.values() for n in names)
_LORA_INFO = "vllm:lora_requests_info"
_CACHE_INFO = "vllm:cache_config_info"
# The samples a snapshot reads (a scrape parses only these lines: about a fifth of the page).
_READ = frozenset(
    {
        *(n + t for names in (*_MEAN.values(), *_SUM.values()) for n in names for t in ("", "_total")),
        *(n + s for n in _HISTOGRAM_NAMES for s in ("_bucket", "_sum", "_count")),
        _LORA_INFO,
        _CACHE_INFO,
    }
)


def _split_adapters(v: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in v.split(",")) if a)


def parse_load_snapshot(text: str) -> LoadSnapshot:
    """Parse a ``/metrics`` page (vLLM, the simulated replica, or anything with the same names).

    Only the series the snapshot holds are parsed (``model_names`` are the ``model_name`` labels
    of those). Raises :class:`~replicas.wire.prom.PromParseError` (a ``ValueError``) for a page
    that is not Prometheus text; the scraper then keeps the replica's previous snapshot.
    """
    samples = list(parse_samples(text, _READ))
    values: dict[str, list[float]] = {}  # by name without `_total`: each series' value
    lora_latest: Sample | None = None
    models: set[str] = set()
    block_size = num_blocks = None
    for s in samples:
        name, labels = s.name, s.labels
        if "model_name" in labels:
            models.add(labels["model_name"])
        if name == _LORA_INFO:
            # One series per adapter set ever seen; its value is when it was last current.
            if lora_latest is None or s.value >= lora_latest.value:
                lora_latest = s
            continue
        if name == _CACHE_INFO:
            bs, nb = labels.get("block_size"), labels.get("num_gpu_blocks")
            if bs and bs.isdigit():
                block_size = int(bs)
            if nb and nb.isdigit():
                num_blocks = (num_blocks or 0) + int(nb)  # each engine has its own cache
            continue
        if name.endswith(("_bucket", "_created")):
            continue
        if name.endswith("_total"):
            name = name[: -len("_total")]
        values.setdefault(name, []).append(s.value)
    histograms = sum_histograms(samples, _HISTOGRAM_NAMES)

    def first(names: tuple[str, ...]) -> list[float]:
        return next((values[n] for n in names if n in values), [])

    kwargs: dict[str, object] = {f: sum(first(n)) for f, n in _SUM.items()}
    for f, n in _MEAN.items():
        v = first(n)
        kwargs[f] = min(1.0, max(0.0, sum(v) / len(v))) if v else 0.0
    for f, n in _HISTOGRAMS.items():
        kwargs[f] = next((histograms[h] for h in n if h in histograms), None)
    if lora_latest is not None:
        labels = lora_latest.labels
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
