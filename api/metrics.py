"""The gateway's own metrics: Prometheus series and the sliding windows ``GET /admin/load`` reads.

Prometheus (``GET /metrics``):

* ``tidal_gateway_ttft_seconds``, ``tidal_gateway_tpot_seconds``,
  ``tidal_gateway_queue_wait_seconds`` -- histograms by pool and class (measured by the gateway);
* ``tidal_admission_outcomes_total{class, feature, outcome}`` -- admitted, queued,
  rejected_429, overflowed, context_cap_400, errors;
* ``tidal_router_decisions_total{profile, replica}``, ``tidal_router_prefix_total{result}``
  (hit / followed / walked / miss / none), ``tidal_router_session_total{result}``,
  ``tidal_router_prefill_cost_total{result}`` (cached: placed where part of the prompt is
  cached; cold: cached nowhere, placed where the least prefill waits),
  ``tidal_router_kv_index_total{source}`` (exact: every candidate's cache state came from its KV
  events; estimate: from none; mixed), and ``tidal_router_kv_events_*`` per replica
  (:class:`router.kv_events.KVEventsTracker`: index age, blocks, gaps, rebuilds, ...),
  ``tidal_router_ring_walks_total``, ``tidal_router_adapter_loads_total{replica}``,
  ``tidal_router_adapter_evictions_total{replica}``,
  ``tidal_router_plugin_duration_seconds{extension, type, name}`` (one decision in 8 is timed);
* ``tidal_gateway_retries_total{reason}``, ``tidal_gateway_upstream_errors_total{replica}``,
  ``tidal_gateway_overflow_requests_total{result}``;
* ``tidal_gateway_connections_cut_total{reason}`` -- connections the server's bounds ended
  (:mod:`api.protocol`: head_too_large, head_timeout, idle, body_timeout, send_timeout), and
  those that sent what is not HTTP (bad_request);
* ``tidal_gateway_replica_inflight{replica, pool}``, ``tidal_gateway_replica_cap{replica, pool}``,
  ``tidal_admission_queue_depth{pool}`` -- read from live state at scrape time.

Under ``tidal gateway --workers N`` a scrape answers with every worker's series, each labelled
``worker`` (:mod:`api.worker_metrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tidal.api.protocol import CUT_REASONS, CUTS
from tidal.clock import Clock
from tidal.priority.admission import Admission, Outcome
from tidal.priority.window import SlidingWindow
from tidal.replicas.wire.prom import LabelledHistogram
from tidal.router.metrics import Children, RouterMetrics
from tidal.router.registry import ReplicaRegistry

__all__ = ["GatewayMetrics", "PoolWindows"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)


@dataclass
class PoolWindows:
    """What happened on one pool over the last few seconds."""

    ttft: SlidingWindow
    tpot: SlidingWindow
    requests: SlidingWindow
    errors: SlidingWindow


@dataclass
class _Group:
    requests: int = 0
    errors: int = 0
    window_requests: SlidingWindow | None = None
    window_errors: SlidingWindow | None = None


@dataclass(eq=False)
class _LiveState(Collector):
    registry: ReplicaRegistry
    admission: Admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "tidal_gateway_replica_inflight",
            "Interactive requests in flight per replica",
            labels=["replica", "pool"],
        )
        cap = GaugeMetricFamily(
            "tidal_gateway_replica_cap", "Adaptive in-flight cap per replica", labels=["replica", "pool"]
        )
        for s in self.registry:
            inflight.add_metric([s.name, s.pool], s.inflight)
            cap.add_metric([s.name, s.pool], s.cap.value)
        depth = GaugeMetricFamily(
            "tidal_admission_queue_depth", "Requests waiting in the gateway", labels=["pool"]
        )
        for pool in self.registry.pools():
            depth.add_metric([pool], self.admission.queue_depth(pool))
        yield inflight
        yield cap
        yield depth


@dataclass
class GatewayMetrics(RouterMetrics):
    """Prometheus series plus the windows behind ``/admin/load``; also the router's observer
    (the router's own series: :class:`~router.metrics.RouterMetrics`)."""

    clock: Clock
    window_s: float = 5.0
    pools: dict[str, PoolWindows] = field(default_factory=dict)
    groups: dict[str, _Group] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        r = self.prom
        self.ttft = LabelledHistogram(
            "tidal_gateway_ttft_seconds",
            "Time to first token seen by the gateway",
            ["pool", "class"],
            _LATENCY,
            r,
        )
        self.tpot = LabelledHistogram(
            "tidal_gateway_tpot_seconds",
            "Time per output token of streamed requests",
            ["pool", "class"],
            _TPOT,
            r,
        )
        self.queue_wait = LabelledHistogram(
            "tidal_gateway_queue_wait_seconds",
            "Time waiting in the gateway queue",
            ["pool", "class"],
            _LATENCY,
            r,
        )
        self.outcomes = Counter(
            "tidal_admission_outcomes", "Admission outcomes", ["class", "feature", "outcome"], registry=r
        )
        # Per tenant: its names come from the fleet config's keys, so the labels stay bounded.
        self.tenant_requests = Counter(
            "tidal_tenant_requests",
            "Requests per tenant by outcome: admission's, or quota_requests / quota_tokens when its quota refused",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_wait = LabelledHistogram(
            "tidal_tenant_queue_wait_seconds",
            "Time a tenant's admitted requests waited in the gateway queue",
            ["tenant"],
            _LATENCY,
            r,
        )
        self.tenant_tokens = Counter(
            "tidal_tenant_tokens",
            "Tokens per tenant: prompt (estimated at admission) and completion (as generated)",
            ["tenant", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "tidal_gateway_retries", "Requests retried on another replica", ["reason"], registry=r
        )
        self.upstream_errors = Counter(
            "tidal_gateway_upstream_errors", "Upstream failures by replica", ["replica"], registry=r
        )
        # Known label values start at 0, so rates and alerts read 0 rather than "no data".
        for reason in ("ReplicaUnavailable", "ReplicaTimeout", "ReplicaServerError", "ReplicaStreamError"):
            self.retries.labels(reason)
        self.overflow_requests = Counter(
            "tidal_gateway_overflow_requests",
            "Requests sent to the external provider",
            ["result"],
            registry=r,
        )
        self._outcomes = Children(self.outcomes)
        r.register(_ConnectionCuts())

    def attach_live(self, registry: ReplicaRegistry, admission: Admission) -> None:
        self.prom.register(_LiveState(registry, admission))

    def replica_added(self, name: str) -> None:
        """A replica joined routing: its error counter exists from now on, at 0."""
        self.upstream_errors.labels(name)

    def replica_removed(self, name: str) -> None:
        """A replica left routing: its series go (a run-time registration does not leave one
        behind for ever)."""
        with contextlib.suppress(KeyError):
            self.upstream_errors.remove(name)

    def pool(self, name: str) -> PoolWindows:
        w = self.pools.get(name)
        if w is None:
            mk: Callable[[], SlidingWindow] = lambda: SlidingWindow(self.window_s, self.clock)  # noqa: E731
            w = self.pools[name] = PoolWindows(mk(), mk(), mk(), mk())
        return w

    def group(self, name: str) -> _Group:
        g = self.groups.get(name)
        if g is None:
            g = self.groups[name] = _Group(
                window_requests=SlidingWindow(self.window_s, self.clock),
                window_errors=SlidingWindow(self.window_s, self.clock),
            )
        return g

    # -- recording -------------------------------------------------------------------------------

    def outcome(self, class_name: str, feature: str, outcome: Outcome) -> None:
        self._outcomes(class_name, feature, outcome.value).inc()

    def tenant_outcome(self, tenant: str, outcome: Outcome) -> None:
        self.tenant_requests.labels(tenant or "-", outcome.value).inc()

    def tenant_refused(self, tenant: str, reason: str) -> None:
        self.tenant_requests.labels(tenant or "-", reason).inc()

    def tenant_served(self, tenant: str, wait_s: float) -> None:
        self.tenant_wait.labels(tenant or "-").observe(wait_s)

    def tenant_used(self, tenant: str, prompt_tokens: int, completion_tokens: int | None) -> None:
        self.tenant_tokens.labels(tenant or "-", "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tenant_tokens.labels(tenant or "-", "completion").inc(completion_tokens)

    def request_done(self, pool: str, group: str | None, *, failed: bool) -> None:
        w = self.pool(pool)
        w.requests.add()
        if failed:
            w.errors.add()
        if group is not None:
            g = self.group(group)
            g.requests += 1
            assert g.window_requests is not None and g.window_errors is not None
            g.window_requests.add()
            if failed:
                g.errors += 1
                g.window_errors.add()

    def first_token(self, pool: str, class_name: str, ttft_s: float) -> None:
        self.ttft.labels(pool, class_name).observe(ttft_s)
        self.pool(pool).ttft.add(ttft_s)

    def queued(self, pool: str, class_name: str, wait_s: float) -> None:
        self.queue_wait.labels(pool, class_name).observe(wait_s)

    def token_time(self, pool: str, class_name: str, tpot_s: float) -> None:
        self.tpot.labels(pool, class_name).observe(tpot_s)
        self.pool(pool).tpot.add(tpot_s)


class _ConnectionCuts(Collector):
    """``tidal_gateway_connections_cut_total{reason}``, read from the process's tally at scrape
    time (every reason from 0)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        cuts = CounterMetricFamily(
            "tidal_gateway_connections_cut",
            "Client connections ended by the server's bounds on heads, bodies and reading, or for bytes that are not HTTP",
            labels=["reason"],
        )
        for reason in CUT_REASONS:
            cuts.add_metric([reason], CUTS[reason])
        yield cuts
