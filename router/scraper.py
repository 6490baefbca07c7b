"""The background loop that scrapes every replica's ``/metrics``, off the request path.

Every ``interval_s`` (the fleet's ``gateway.scrape_interval_s``, 1 s by default) it fetches each
replica's ``/metrics`` concurrently and stores the parsed
:class:`~replicas.metrics.LoadSnapshot` in the registry; the request path only ever reads the
last snapshot and its age. Every ``models_every`` rounds it also reads ``/v1/models`` to learn
which LoRA adapters a replica holds (adapters loaded by someone else, or lost in a restart).
A replica that does not answer keeps its old snapshot, which grows stale; taking replicas out of
routing is the health prober's job (``PATCH /admin/replicas/{name}``).

Example::

    scraper = MetricsScraper(registry, interval_s=1.0, clock=SystemClock())
    task = asyncio.create_task(scraper.run_forever())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tidal.clock import Clock
from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaError
from tidal.router.registry import ReplicaRegistry, ReplicaState

__all__ = ["MetricsScraper"]

log = logging.getLogger(__name__)


class MetricsScraper:
    def __init__(
        self,
        registry: ReplicaRegistry,
        *,
        interval_s: float,
        clock: Clock,
        timeout_s: float | None = None,
        models_every: int = 30,
    ) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.clock = clock
        self.timeout_s = timeout_s or max(0.5, min(5.0, interval_s * 2))
        self.models_every = models_every
        self.rounds = 0
        self.failures = 0

    async def _one(self, state: ReplicaState, with_models: bool) -> None:
        client = state.client
        if not isinstance(client, ReplicaClient):
            return
        try:
            snap = await client.load_snapshot(timeout=self.timeout_s)
        except (ReplicaError, ValueError) as exc:
            self.failures += 1
            log.debug("scrape of %s failed: %s", state.name, exc)
            return
        self.registry.update_snapshot(state.name, snap)
        if with_models:
            with contextlib.suppress(ReplicaError, ValueError, AttributeError):
                models = await client.models()
                for m in models:
                    if m.get("parent") and isinstance(m.get("id"), str):
                        state.adapters.setdefault(m["id"], 0.0)

    async def scrape_once(self) -> None:
        with_models = self.rounds % self.models_every == 0
        self.rounds += 1
        await asyncio.gather(*(self._one(s, with_models) for s in self.registry))

    async def run_forever(self) -> None:
        while True:
            started = self.clock.now()
            try:
                await self.scrape_once()
            except Exception:  # the loop must survive anything a replica sends
                log.exception("metrics scrape round failed")
            await self.clock.sleep(max(0.0, self.interval_s - (self.clock.now() - started)))
