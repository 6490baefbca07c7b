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

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tidal.clock import Clock
from tidal.fleet import FleetConfig
from tidal.priority.admission import Admission
from tidal.router.redis_load import RedisLoadStore
from tidal.router.registry import ReplicaRegistry
from tidal.router.shared import SharedLoad
from tidal.settings import Settings

__all__ = ["AdminFeed", "build_shared_load"]

log = logging.getLogger(__name__)

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
    pool_rates: Callable[[], Mapping[str, tuple[float, float]]] | None = None,
    counters: Callable[[], Mapping[str, int]] | None = None,
) -> SharedLoad | None:
    """The sync loop of this process when ``TIDAL_REDIS_URL`` is set (not started), else ``None``;
    ``pool_rates`` -- this process's requests and errors per second per pool, published;
    ``counters`` -- its cumulative counters, added up with every other process's."""
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
        pool_rates=pool_rates,
        counters=counters,
        on_freed=on_freed,
        on_sync=observed,
    )
    prom.register(_SharedStateMetrics(shared))
    return shared


class AdminFeed:
    """Admin changes made at one gateway process, applied by every other: a Redis stream.

    ``POST``, ``PATCH`` and ``DELETE /admin/replicas`` change the process that answers them;
    with several gateways (or ``--workers N``, where a call reaches whichever worker accepts its
    connection) the others would never hear of it. So each change is also appended to the stream
    ``<namespace>:admin`` (``XADD``, the newest ``maxlen`` kept) with the process that made it,
    and every process reads the stream (``XREAD``, blocking up to a second) and applies what the
    others made, in order. A process starting reads it from the beginning, so a gateway started
    after replicas were registered, patched or removed ends in the same state (a registration of
    a name it already has, or a change to one it does not, is skipped). A process that cannot
    reach Redis keeps serving with what it has and catches up when Redis answers.

    ``apply(op, data)`` makes one change: ``register`` (the ``POST`` body), ``patch`` (``name``
    and the ``PATCH`` body) or ``remove`` (``name``, ``timeout_s``)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        origin: str,
        apply: Callable[[str, dict[str, Any]], Awaitable[None]],
        maxlen: int = 10_000,
        timeout_s: float = 2.0,
    ) -> None:
        self.key = f"{namespace}:admin"
        self.origin = origin
        self.apply = apply
        self.maxlen = maxlen
        self.applied = 0
        self._last = "0"  # from the beginning: converge on what happened before this process
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._down_logged = False

    async def publish(self, op: str, data: dict[str, Any]) -> None:
        """Tell the other processes (best effort: a change Redis did not take stays local)."""
        try:
            await self._redis.xadd(
                self.key,
                {"origin": self.origin, "op": op, "data": json.dumps(data)},
                maxlen=self.maxlen,
                approximate=True,
            )
        except (RedisError, OSError) as exc:
            log.warning("admin change %s not shared with the other gateways: %s", op, exc)

    async def poll(self, block_ms: int | None = None) -> int:
        """Apply the others' changes since the last call; how many were applied."""
        got: Any = await self._redis.xread({self.key: self._last}, count=256, block=block_ms)
        n = 0
        for _key, entries in got or ():
            for entry_id, raw in entries:
                self._last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                fields = {_text(k): _text(v) for k, v in raw.items()}
                if fields.get("origin") == self.origin:
                    continue
                try:
                    await self.apply(fields["op"], json.loads(fields["data"]))
                    n += 1
                except Exception:  # one bad or stale change must not stop the others
                    log.exception("could not apply a shared admin change %s", fields.get("op"))
        self.applied += n
        return n

    async def run_forever(self) -> None:
        while True:
            try:
                await self.poll(block_ms=1000)
                self._down_logged = False
            except (RedisError, OSError) as exc:
                if not self._down_logged:
                    log.warning("shared admin changes unavailable (%s); retrying", exc)
                    self._down_logged = True
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
