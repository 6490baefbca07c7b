"""The router's Prometheus series, and the :class:`~router.framework.RouterObserver` that fills
them from every decision (the gateway's metrics extend it: :class:`api.metrics.GatewayMetrics`).

* ``tidal_router_decisions_total{profile, replica}``, ``tidal_router_prefix_total{result}``
  (hit / followed / walked / miss / none), ``tidal_router_session_total{result}``,
  ``tidal_router_prefill_cost_total{result}``, ``tidal_router_kv_index_total{source}``,
  ``tidal_router_ring_walks_total``, ``tidal_router_adapter_loads_total{replica}``,
  ``tidal_router_adapter_evictions_total{replica}``,
  ``tidal_router_plugin_duration_seconds{extension, type, name}`` (the sampled decisions' plugin
  calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from tidal.replicas.wire.prom import LabelledHistogram
from tidal.router.types import RouteResult

__all__ = ["Children", "RouterMetrics"]

_PLUGIN = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class Children:
    """A labelled counter's children, cached by label values: ``labels()`` checks, converts and
    takes a lock on every call, which the per-request path need not pay. The label values are
    bounded (pools, classes, features, replicas and profiles of the fleet; router notes)."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: Counter) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


@dataclass
class RouterMetrics:
    """The router's series in ``prom``; an observer for :class:`~router.framework.Router`."""

    prom: CollectorRegistry

    def __post_init__(self) -> None:
        r = self.prom
        self.decisions = Counter(
            "tidal_router_decisions", "Routing decisions", ["profile", "replica"], registry=r
        )
        self.prefix = Counter("tidal_router_prefix", "Prefix-ring placement results", ["result"], registry=r)
        self.session = Counter(
            "tidal_router_session", "Session-ring placement results", ["result"], registry=r
        )
        self.prefill_cost = Counter(
            "tidal_router_prefill_cost",
            "Prefill-cost placements: where the prompt is partly cached, or cold",
            ["result"],
            registry=r,
        )
        self.kv_index = Counter(
            "tidal_router_kv_index",
            "Decisions by where the candidates' cache state came from (exact KV events, estimate, mixed)",
            ["source"],
            registry=r,
        )
        self.ring_walks = Counter(
            "tidal_router_ring_walks", "Replicas skipped on the ring (over the load bound)", registry=r
        )
        self.adapter_loads = Counter(
            "tidal_router_adapter_loads", "LoRA adapters loaded", ["replica"], registry=r
        )
        self.adapter_evictions = Counter(
            "tidal_router_adapter_evictions", "LoRA adapters unloaded to make room", ["replica"], registry=r
        )
        self.plugin_seconds = LabelledHistogram(
            "tidal_router_plugin_duration_seconds",
            "Time in each router plugin call",
            ["extension", "type", "name"],
            _PLUGIN,
            r,
        )
        self._decisions = Children(self.decisions)
        self._prefix = Children(self.prefix)
        self._session = Children(self.session)
        self._prefill_cost = Children(self.prefill_cost)
        self._kv_index = Children(self.kv_index)

    # -- RouterObserver ----------------------------------------------------------------------------

    def plugin_timed(self, kind: str, type_: str, name: str, seconds: float) -> None:
        self.plugin_seconds.labels(kind, type_, name).observe(seconds)

    def decided(self, profile: str, result: RouteResult | None) -> None:
        if result is None:
            self._decisions(profile, "none").inc()
            return
        self._decisions(profile, result.replica.name).inc()
        notes = result.notes
        if "prefix" in notes:
            self._prefix(notes["prefix"]).inc()
        if "session" in notes:
            self._session(notes["session"]).inc()
        if "prefill_cost" in notes:
            self._prefill_cost(notes["prefill_cost"]).inc()
        if "kv_index" in notes:
            self._kv_index(notes["kv_index"]).inc()
        walks = notes.get("ring_walks")
        if walks:
            self.ring_walks.inc(walks)
