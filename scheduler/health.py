"""The health prober: a one-token canary generation per replica every few seconds.

Every ``period_s`` each registered, non-draining replica gets a tiny completion
(``max_tokens: 1``) with a timeout. A replica that fails once is taken out of routing **at once**
(``PATCH /admin/replicas/{name} {"healthy": false}``: the gateway also fails its in-flight
requests fast with a retryable error); it returns only after ``recover_after`` consecutive
successes. One that stays unhealthy for ``replace_after_s`` is drained and replaced through the
actuator (once; an actuator that does not manage it leaves it out of routing).

A replica that is unhealthy and not draining is the prober's to judge, whoever marked it: to keep
one out by hand, drain it or set its weight to 0.

With a timeout ``timeout_s`` below ``period_s``, a hung replica (e.g. SIGSTOP) is out of
routing within ``period_s + timeout_s``, i.e. under two probe periods.

Example::

    prober = HealthProber(gateway_admin, CanaryGeneration({"interactive": "llama"}), clock=SystemClock(),
                          actuator=local_actuator)
    await prober.run(stop)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tidal.clock import Clock
from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaError
from tidal.scheduler.autoscaler.actuators import Actuator
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import ReplicaRegistry, ReplicaView

__all__ = ["CanaryGeneration", "HealthEvent", "HealthProber", "ProbeResult", "Prober"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str = ""


class Prober(Protocol):
    """Checks one replica; must return (not raise) within its own timeout."""

    async def probe(self, replica: ReplicaView) -> ProbeResult: ...


class CanaryGeneration:
    """The default prober: ``POST /v1/completions`` with one token, through :class:`ReplicaClient`.

    **Parameters:** ``models`` -- the served model name per pool; ``timeout_s`` -- the whole
    generation must finish within it; ``priority`` -- vLLM request priority to send (only for
    replicas started with ``--scheduling-policy priority``; ``None`` sends none);
    ``embedding_pools`` -- pools serving an embedding model, probed with a one-word
    ``POST /v1/embeddings`` instead (they cannot generate).
    """

    def __init__(
        self,
        models: Mapping[str, str],
        *,
        timeout_s: float = 1.5,
        priority: int | None = None,
        api_key: str | None = None,
        embedding_pools: Collection[str] = (),
    ) -> None:
        self.models = dict(models)
        self.embedding_pools = frozenset(embedding_pools)
        self.timeout_s = timeout_s
        self.priority = priority
        self.api_key = api_key
        self._clients: dict[str, ReplicaClient] = {}

    def _client(self, url: str) -> ReplicaClient:
        c = self._clients.get(url)
        if c is None:
            c = self._clients[url] = ReplicaClient(
                url,
                api_key=self.api_key,
                pool_size=4,
                connect_timeout=self.timeout_s,
                read_timeout=self.timeout_s,
            )
        return c

    async def probe(self, replica: ReplicaView) -> ProbeResult:
        model = self.models.get(replica.pool)
        if model is None:
            return ProbeResult(False, 0.0, f"no model known for pool {replica.pool}")
        embedding = replica.pool in self.embedding_pools
        payload: dict[str, object] = (
            {"model": model, "input": "ping"}
            if embedding
            else {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0.0}
        )
        if self.priority is not None:
            payload["priority"] = self.priority
        client = self._client(replica.url)
        call = client.embeddings if embedding else client.completions
        t0 = time.perf_counter()
        try:
            reply = await asyncio.wait_for(call(payload, timeout=self.timeout_s), self.timeout_s)
        except (ReplicaError, TimeoutError) as exc:
            return ProbeResult(False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        latency = time.perf_counter() - t0
        key = "data" if embedding else "choices"
        items = reply.get(key) if isinstance(reply, dict) else None
        if not isinstance(items, list) or not items:
            return ProbeResult(False, latency, f"answer without {key}")
        return ProbeResult(True, latency)

    async def forget(self, keep_urls: Sequence[str]) -> None:
        """Close the connection pools of replicas that are gone."""
        for url in [u for u in self._clients if u not in set(keep_urls)]:
            await self._clients.pop(url).aclose()

    async def aclose(self) -> None:
        await self.forget([])


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """Something the prober did: ``removed``, ``restored``, ``replaced`` or ``unreplaceable``."""

    replica: str
    pool: str
    action: str
    detail: str
    at: float


@dataclass
class _Health:
    ok_streak: int = 0
    unhealthy_since: float | None = None
    replace_done: bool = False


class HealthProber:
    """Probes every replica each period and keeps the router's ``healthy`` flags true to it."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        prober: Prober,
        *,
        clock: Clock,
        period_s: float = 2.0,
        recover_after: int = 3,
        replace_after_s: float = 60.0,
        actuator: Actuator | None = None,
        metrics: SchedulerMetrics | None = None,
        max_parallel: int = 64,
    ) -> None:
        if recover_after < 1 or period_s <= 0:
            raise ValueError("recover_after must be >= 1 and period_s > 0")
        self.registry = registry
        self.prober = prober
        self.clock = clock
        self.period_s = period_s
        self.recover_after = recover_after
        self.replace_after_s = replace_after_s
        self.actuator = actuator
        self.metrics = metrics or SchedulerMetrics()
        self._sem = asyncio.Semaphore(max_parallel)
        self._state: dict[str, _Health] = {}

    async def _probe(self, view: ReplicaView) -> ProbeResult:
        async with self._sem:
            try:
                return await self.prober.probe(view)
            except Exception as exc:  # a broken prober is a failed probe, never a dead loop
                return ProbeResult(False, 0.0, f"prober raised {type(exc).__name__}: {exc}")

    async def step(self) -> list[HealthEvent]:
        """Probe every registered, non-draining replica once and act on the results."""
        try:
            views = [v for v in await self.registry.replicas() if not v.draining]
        except Exception as exc:
            log.warning("health: cannot list replicas: %s", exc)
            return []
        results = await asyncio.gather(*(self._probe(v) for v in views))
        now = self.clock.now()
        events: list[HealthEvent] = []
        for view, res in zip(views, results, strict=True):
            self.metrics.probes.labels(view.name, "ok" if res.ok else "fail").inc()
            if res.ok:
                self.metrics.probe_seconds.observe(res.latency_s)
            ev = await self._judge(view, res, now)
            if ev is not None:
                events.append(ev)
        names = {v.name for v in views}
        for gone in [n for n in self._state if n not in names]:
            del self._state[gone]
        forget = getattr(self.prober, "forget", None)
        if forget is not None:
            await forget([v.url for v in views])
        return events

    async def _judge(self, view: ReplicaView, res: ProbeResult, now: float) -> HealthEvent | None:
        st = self._state.setdefault(view.name, _Health())
        if res.ok:
            st.ok_streak += 1
            if view.healthy:
                st.unhealthy_since = None
                return None
            if st.ok_streak < self.recover_after:
                return None
            if await self._set_healthy(view, True):
                st.unhealthy_since, st.replace_done = None, False
                return self._event(view, "restored", f"{st.ok_streak} consecutive successful probes", now)
            return None
        st.ok_streak = 0
        if st.unhealthy_since is None:
            st.unhealthy_since = now
        if view.healthy:
            # Out of routing at once: one failed canary is enough to stop sending users there.
            if await self._set_healthy(view, False):
                return self._event(view, "removed", res.error, now)
            return None  # still listed healthy: the next period tries again
        if (
            self.actuator is not None
            and not st.replace_done
            and now - st.unhealthy_since >= self.replace_after_s
        ):
            st.replace_done = True
            try:
                replaced = await self.actuator.replace(view.pool, view.name)
            except Exception as exc:
                log.warning("health: replacing %s failed: %s", view.name, exc)
                st.replace_done = False  # try again next period
                return None
            if replaced:
                self.metrics.replacements.labels(view.pool).inc()
                return self._event(view, "replaced", f"unhealthy for {now - st.unhealthy_since:.0f} s", now)
            return self._event(
                view, "unreplaceable", f"actuator {self.actuator.name} does not manage it", now
            )
        return None

    async def _set_healthy(self, view: ReplicaView, healthy: bool) -> bool:
        try:
            await self.registry.update(view.name, healthy=healthy)
        except Exception as exc:
            log.warning("health: marking %s healthy=%s failed: %s", view.name, healthy, exc)
            return False
        self.metrics.health_transitions.labels(view.name, "healthy" if healthy else "unhealthy").inc()
        return True

    def _event(self, view: ReplicaView, action: str, detail: str, now: float) -> HealthEvent:
        log.info("health: %s %s (%s)", view.name, action, detail)
        return HealthEvent(view.name, view.pool, action, detail, now)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Probe every ``period_s`` (from the start of one round to the next) until ``stop``."""
        stop = stop or asyncio.Event()
        next_at = self.clock.now()
        while not stop.is_set():
            await self.step()
            next_at += self.period_s
            delay = next_at - self.clock.now()
            if delay < 0:
                next_at, delay = self.clock.now(), 0.0
            await self.clock.sleep(delay)
