"""Local-process actuator: start and stop replicas on this machine and (de)register them.

A pool's replicas started here come from a launch template (``tidal sim --preset ...`` or a real
vLLM server, via :mod:`replicas.launcher`). A new replica is registered with the gateway
(``POST /admin/replicas``) only once its ``/health`` answers; a removed one is deregistered first
(the gateway drains it) and then stopped. Only replicas this actuator started are ever stopped:
replicas listed in the fleet config count towards the pool's size but are left alone. Every
``reconcile_every_s`` it also registers again any of its ready replicas the gateway no longer
lists (a restarted gateway knows only its fleet file), so they serve again within one period.

Example::

    actuator = LocalProcessActuator(
        {"interactive": LocalTemplate(kind="sim", preset="llama-3.1-8b-h100", served_model_name="llama")},
        registry=gateway_admin, fixed={"interactive": 2},
    )
    await actuator.scale("interactive", 4)     # starts two processes, registers each when healthy
    ...
    await actuator.aclose()                     # deregisters and stops what it started
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process, vllm_process
from tidal.scheduler.autoscaler.actuators import PoolReplicas
from tidal.scheduler.signals import PoolLoad, ReplicaRegistry

__all__ = ["LocalProcessActuator", "LocalTemplate", "ProcessFactory"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalTemplate:
    """How to start one more replica of a pool on this machine."""

    kind: Literal["sim", "vllm"]
    served_model_name: str
    preset: str | None = None  # sim
    model_dir: str | None = None  # vllm
    args: Sequence[str] = ()
    group: str = "stable"
    max_loras: int = 0
    kv_events: bool = False  # publish KV-cache events (free ports), announced when registering

    def __post_init__(self) -> None:
        if self.kind == "sim" and not self.preset:
            raise ValueError("a sim template needs a preset")
        if self.kind == "vllm" and not self.model_dir:
            raise ValueError("a vllm template needs model_dir")


# (pool, replica name, port, log path) -> a process not yet started
ProcessFactory = Callable[[str, str, int, Path], ReplicaProcess]


@dataclass
class _Managed:
    name: str
    proc: ReplicaProcess
    state: Literal["starting", "ready", "stopping"] = "starting"
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class LocalProcessActuator:
    """Replicas as local processes (see the module docstring).

    **Parameters:** ``templates`` -- per pool; ``registry`` -- the gateway admin API;
    ``fixed`` -- replicas of a pool that exist without this actuator (fleet config);
    ``factory`` -- overrides how a process is built from a template; ``ready_timeout_s`` -- a
    replica not healthy by then is stopped and counted as failed; ``max_starting`` -- bound on
    simultaneous cold starts per pool (each one loads a model); ``reconcile_every_s`` -- how often
    :meth:`observe` checks that the gateway still lists this actuator's ready replicas.
    """

    name = "local"

    def __init__(
        self,
        templates: Mapping[str, LocalTemplate],
        *,
        registry: ReplicaRegistry,
        fixed: Mapping[str, int] | None = None,
        factory: ProcessFactory | None = None,
        log_dir: Path = Path(".tidal/logs/autoscaler"),
        ready_timeout_s: float = 300.0,
        max_starting: int = 8,
        name_prefix: str = "auto",
        reconcile_every_s: float = 10.0,
    ) -> None:
        self.templates = dict(templates)
        self.registry = registry
        self.fixed = dict(fixed or {})
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.max_starting = max_starting
        self.name_prefix = name_prefix
        self._factory = factory or self._default_factory
        self._owned: dict[str, dict[str, _Managed]] = {p: {} for p in templates}
        self._seq = itertools.count()
        self._lock = asyncio.Lock()
        self.failed_starts = 0
        self.reconcile_every_s = reconcile_every_s
        self._reconciled_at = -math.inf
        self.reregistered = 0

    def _default_factory(self, pool: str, name: str, port: int, log_path: Path) -> ReplicaProcess:
        t = self.templates[pool]
        if t.kind == "sim":
            assert t.preset is not None
            return sim_process(
                t.preset,
                port=port,
                name=name,
                args=["--served-model-name", t.served_model_name, *t.args],
                log_path=log_path,
                kv_events=t.kv_events,
            )
        assert t.model_dir is not None
        return vllm_process(
            t.model_dir,
            port=port,
            name=name,
            log_path=log_path,
            served_model_name=t.served_model_name,
            max_loras=t.max_loras,
            extra_args=tuple(t.args),
            kv_events=t.kv_events,
        )

    def _pool(self, pool: str) -> dict[str, _Managed]:
        if pool not in self._owned:
            raise KeyError(f"no launch template for pool {pool}")
        return self._owned[pool]

    def managed(self, pool: str) -> list[tuple[str, str, str]]:
        """``(name, url, state)`` of the replicas this actuator runs for ``pool``."""
        return [(m.name, m.proc.url, m.state) for m in self._pool(pool).values()]

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        if time.monotonic() - self._reconciled_at >= self.reconcile_every_s and not self._lock.locked():
            await self._reconcile()
        owned = self._pool(pool).values()
        # A process that died on its own is no longer ready; the next scale() replaces it.
        ready = sum(1 for m in owned if m.state == "ready" and m.proc.running())
        starting = sum(1 for m in owned if m.state == "starting")
        return PoolReplicas(ready=self.fixed.get(pool, 0) + ready, starting=starting)

    async def scale(self, pool: str, replicas: int) -> None:
        async with self._lock:
            owned = self._pool(pool)
            for m in [m for m in owned.values() if m.state == "ready" and not m.proc.running()]:
                log.warning("local actuator: replica %s exited on its own; removing it", m.name)
                await self._remove(pool, m)
            live = [m for m in owned.values() if m.state in ("starting", "ready")]
            want = max(0, replicas - self.fixed.get(pool, 0))
            if want > len(live):
                starting = sum(1 for m in live if m.state == "starting")
                for _ in range(min(want - len(live), max(0, self.max_starting - starting))):
                    self._start(pool)
            elif want < len(live):
                # Cancel cold starts first (they serve nobody yet), then the newest ready ones.
                order = [m for m in reversed(live) if m.state == "starting"]
                order += [m for m in reversed(live) if m.state == "ready"]
                for m in order[: len(live) - want]:
                    await self._remove(pool, m)

    async def _reconcile(self) -> None:
        """Register again the ready replicas the gateway does not list (it restarted)."""
        async with self._lock:
            self._reconciled_at = time.monotonic()
            ready = [
                (pool, m)
                for pool, owned in self._owned.items()
                for m in owned.values()
                if m.state == "ready" and m.proc.running()
            ]
            if not ready:
                return
            try:
                listed = {r.name for r in await self.registry.replicas()}
                for pool, m in ready:
                    if m.name not in listed:
                        await self._register(pool, m)
                        self.reregistered += 1
                        log.warning(
                            "local actuator: the gateway did not list %s; registered it again", m.name
                        )
            except Exception as exc:
                log.warning("local actuator: checking the gateway's replicas failed: %s", exc)

    def _start(self, pool: str) -> None:
        name = f"{self.name_prefix}-{pool}-{next(self._seq)}"
        port = free_port()
        proc = self._factory(pool, name, port, self.log_dir / f"{name}.log")
        proc.start()
        m = _Managed(name, proc)
        self._owned[pool][name] = m
        m.task = asyncio.create_task(self._bring_up(pool, m), name=f"bring-up-{name}")
        log.info("local actuator: starting %s on %s for pool %s", name, proc.url, pool)

    async def _register(self, pool: str, m: _Managed) -> None:
        """Register ``m`` with the gateway, with where it publishes KV events when it does."""
        t = self.templates[pool]
        await self.registry.register(
            m.name, m.proc.url, pool, group=t.group, max_loras=t.max_loras, kv_events=m.proc.kv_events_spec()
        )

    async def _bring_up(self, pool: str, m: _Managed) -> None:
        try:
            await asyncio.to_thread(m.proc.wait_ready, self.ready_timeout_s)
            await self._register(pool, m)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed_starts += 1
            log.warning("local actuator: %s did not come up: %s", m.name, exc)
            m.state = "stopping"
            await asyncio.to_thread(m.proc.stop)
            self._owned[pool].pop(m.name, None)
            return
        m.state = "ready"
        log.info("local actuator: %s ready and registered", m.name)

    async def _remove(self, pool: str, m: _Managed) -> None:
        was = m.state
        m.state = "stopping"
        if m.task is not None and not m.task.done():
            m.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await m.task
        if was == "ready" or m.proc.running():
            try:
                await self.registry.deregister(m.name)  # the gateway drains it first
            except Exception as exc:
                log.warning("local actuator: deregistering %s failed: %s", m.name, exc)
        await asyncio.to_thread(m.proc.stop)
        self._owned[pool].pop(m.name, None)
        log.info("local actuator: %s stopped", m.name)

    async def replace(self, pool: str, replica: str) -> bool:
        """Drain and stop ``replica`` and start a fresh one, if this actuator started it."""
        async with self._lock:
            m = self._owned.get(pool, {}).get(replica)
            if m is None:
                return False
            await self._remove(pool, m)
            self._start(pool)
            return True

    async def aclose(self) -> None:
        """Deregister and stop every replica this actuator started."""
        async with self._lock:
            for pool, owned in self._owned.items():
                for m in list(owned.values()):
                    await self._remove(pool, m)
