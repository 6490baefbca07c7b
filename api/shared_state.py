"""One gateway process's part in the shared load state (:mod:`router.shared`): the Redis store
from ``TIDAL_REDIS_URL``, the sync loop, and its metrics.

Prometheus, only when ``TIDAL_REDIS_URL`` is set:

* ``tidal_gateway_shared_state_up{gateway}`` -- 1 while the last sync reached Redis, else 0 (the
  gateway then routes on its own counts once the others' are older than ``shared_state_ttl_s``);
  ``gateway`` is this process's id in Redis (one per worker of ``--workers N``);
* ``tidal_gateway_shared_state_age_seconds`` -- how old the other gateways' counts are now;
* ``tidal_gateway_shared_state_staleness_seconds`` -- histogram of the oldest they got before each
  refresh: the measured staleness bound;
* ``tidal_gateway_shared_state_sync_seconds`` -- histogram of one sync's round trip;
* ``tidal_gateway_shared_state_gateways`` -- live gateway processes, this one included;
* ``tidal_gateway_shared_state_failures_total`` -- syncs that did not reach Redis;
* ``tidal_gateway_replica_inflight_all{replica, pool}`` -- requests in flight there from every
  gateway (``tidal_gateway_replica_inflight`` stays this gateway's own).

Example::

    shared = build_shared_load(settings, fleet, registry, admission, proxy.slot_freed, prom, clock)
    if shared is not None:
        task = asyncio.create_task(shared.run_forever())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from priority.admission import Admission
from router.redis_load import RedisLoadStore
from router.registry import ReplicaRegistry
from router.shared import SharedLoad
from tidal.clock import Clock
from tidal.fleet import FleetConfig
from tidal.settings import Settings

__all__ = ["build_shared_load"]

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)


@dataclass(eq=False)
class _SharedStateMetrics(Collector):
    shared: SharedLoad

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.shared
        up = GaugeMetricFamily(
            "tidal_gateway_shared_state_up",
            "1 while the gateway's last sync reached the shared store (Redis), else 0",
            labels=["gateway"],
        )
        up.add_metric([s.store.gateway_id], 1.0 if s.up else 0.0)
        yield up
        age = s.age_s()
        yield GaugeMetricFamily(
            "tidal_gateway_shared_state_age_seconds",
            "How old the other gateways' load counts are now",
            value=age if math.isfinite(age) else math.inf,
        )
        yield GaugeMetricFamily(
            "tidal_gateway_shared_state_gateways",
            "Live gateway processes sharing load state, this one included",
            value=s.gateways,
        )
        yield CounterMetricFamily(
            "tidal_gateway_shared_state_failures",
            "Syncs that did not reach the shared store",
            value=s.failures,
        )
        inflight = GaugeMetricFamily(
            "tidal_gateway_replica_inflight_all",
            "Interactive requests in flight per replica from every gateway",
            labels=["replica", "pool"],
        )
        for r in s.registry:
            inflight.add_metric([r.name, r.pool], r.inflight + r.remote_inflight)
        yield inflight


def build_shared_load(
    settings: Settings,
    fleet: FleetConfig,
    registry: ReplicaRegistry,
    admission: Admission,
    on_freed: Callable[[str], None],
    prom: CollectorRegistry,
    clock: Clock,
) -> SharedLoad | None:
    """The sync loop of this process when ``TIDAL_REDIS_URL`` is set (not started), else ``None``."""
    if not settings.redis_url:
        return None
    gw = fleet.gateway
    store = RedisLoadStore(
        settings.redis_url,
        namespace=settings.redis_namespace,
        ttl_s=gw.shared_state_ttl_s,
        timeout_s=min(1.0, gw.shared_state_ttl_s / 2),
    )
    sync_seconds = Histogram(
        "tidal_gateway_shared_state_sync_seconds",
        "Round trip of one shared-state sync",
        buckets=_SECONDS,
        registry=prom,
    )
    staleness = Histogram(
        "tidal_gateway_shared_state_staleness_seconds",
        "The oldest the other gateways' counts got before each refresh",
        buckets=_SECONDS,
        registry=prom,
    )

    def observed(took: float, before: float | None) -> None:
        sync_seconds.observe(took)
        if before is not None:
            staleness.observe(before)

    shared = SharedLoad(
        registry,
        store,
        clock=clock,
        interval_s=gw.shared_state_interval_s,
        ttl_s=gw.shared_state_ttl_s,
        timeout_s=min(1.5, gw.shared_state_ttl_s * 0.75),
        queue_depth=admission.queue_depth,
        tenant_load=lambda: admission.held,
        on_freed=on_freed,
        on_sync=observed,
    )
    prom.register(_SharedStateMetrics(shared))
    return shared
