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

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import CounterMetricFamily

from tidal.replicas.wire.prom import LabelledHistogram, counter_family
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
        self._decided = _Decisions(r)
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

    # -- RouterObserver ----------------------------------------------------------------------------

    def plugin_timed(self, kind: str, type_: str, name: str, seconds: float) -> None:
        self.plugin_seconds.labels(kind, type_, name).observe(seconds)

    def decided(self, profile: str, result: RouteResult | None) -> None:
        d = self._decided
        key = (profile, "none" if result is None else result.replica.name)
        d.decisions[key] = d.decisions.get(key, 0) + 1
        if result is None:
            return
        notes = result.notes
        outcome = (
            notes.get("prefix"),
            notes.get("session"),
            notes.get("prefill_cost"),
            notes.get("kv_index"),
        )
        d.outcomes[outcome] = d.outcomes.get(outcome, 0) + 1
        walks = notes.get("ring_walks")
        if walks:
            d.walks += walks


class _Decisions:
    """The decision counters, counted in plain dicts (a ``Counter`` child takes a lock on every
    ``inc``: five per decision cost a thirtieth of one) and summed into their series when
    collected. One entry per profile and replica, and one per combination of the notes' results
    (a few hundred at most)."""

    _OUTCOMES = (
        ("tidal_router_prefix", "Prefix-ring placement results", "result"),
        ("tidal_router_session", "Session-ring placement results", "result"),
        (
            "tidal_router_prefill_cost",
            "Prefill-cost placements: where the prompt is partly cached, or cold",
            "result",
        ),
        (
            "tidal_router_kv_index",
            "Decisions by where the candidates' cache state came from (exact KV events, estimate, mixed)",
            "source",
        ),
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions: dict[tuple[str, ...], int] = {}  # (profile, replica) -> decisions
        self.outcomes: dict[tuple[Any, ...], int] = {}  # the notes' results -> decisions
        self.walks = 0
        self._created = time.time()
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        created = self._created
        yield counter_family(
            "tidal_router_decisions",
            "Routing decisions",
            (({"profile": p, "replica": r}, n) for (p, r), n in list(self.decisions.items())),
            created=created,
        )
        outcomes = list(self.outcomes.items())
        for i, (name, doc, label) in enumerate(self._OUTCOMES):
            sums: dict[str, int] = {}
            for results, n in outcomes:
                if results[i] is not None:
                    sums[results[i]] = sums.get(results[i], 0) + n
            yield counter_family(name, doc, (({label: v}, n) for v, n in sums.items()), created=created)
        yield counter_family(
            "tidal_router_ring_walks",
            "Replicas skipped on the ring (over the load bound)",
            [({}, self.walks)],
            created=created,
        )
