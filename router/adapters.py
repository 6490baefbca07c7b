"""Loading LoRA adapters onto replicas when the router picks one that lacks the adapter.

The router decides *where* (``lora-affinity-scorer`` prefers replicas holding the adapter and
loads it elsewhere only when those are over the load bound); this module does the loading
through vLLM's ``/v1/load_lora_adapter``, honouring each replica's ``max_loras``: when all slots
are taken it first unloads the least recently used adapter with no request in flight, and when
every loaded adapter is busy it refuses (the proxy then tries another replica). Loads on one
replica are serialised; concurrent requests for an adapter being loaded wait for that load.
The registry marks the adapter as held as soon as a load starts, so that the requests that follow
are routed to the same replica instead of starting a second load elsewhere.

Example::

    manager = AdapterManager(registry, {"support-v2": "/models/lora/support-v2"})
    await manager.ensure(state, "support-v2")
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaError, ReplicaUnavailable
from tidal.router.registry import ReplicaRegistry, ReplicaState

__all__ = ["AdapterManager", "AdapterUnavailable"]


class AdapterUnavailable(ReplicaUnavailable):
    """The adapter cannot be placed on this replica now (slots busy, or its load failed)."""


class AdapterManager:
    def __init__(
        self,
        registry: ReplicaRegistry,
        paths: Mapping[str, str],
        *,
        on_load: Callable[[str, str], None] | None = None,
        on_evict: Callable[[str, str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.paths = dict(paths)
        self.on_load = on_load
        self.on_evict = on_evict
        self._locks: dict[str, asyncio.Lock] = {}
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}

    async def ensure(self, state: ReplicaState, adapter: str) -> bool:
        """Make sure ``adapter`` is loaded on ``state``'s replica; True if this call loaded it."""
        pending = self._loading.get((state.name, adapter))
        if pending is not None:
            await asyncio.shield(pending)
            return False
        if adapter in state.adapters:
            return False
        path = self.paths.get(adapter)
        client = state.client
        if path is None or not isinstance(client, ReplicaClient):
            raise AdapterUnavailable(f"adapter '{adapter}' has no known path", replica=state.name)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[(state.name, adapter)] = fut
        state.adapters[adapter] = self.registry.clock.now()  # visible to routing at once
        self.registry.changed(state)
        try:
            async with self._locks.setdefault(state.name, asyncio.Lock()):
                await self._make_room(state, client, adapter)
                await client.load_lora_adapter(adapter, path)
            if self.on_load is not None:
                self.on_load(state.name, adapter)
            fut.set_result(None)
            return True
        except BaseException as exc:
            state.adapters.pop(adapter, None)
            self.registry.changed(state)
            if not fut.done():
                fut.set_exception(
                    exc if isinstance(exc, ReplicaError) else AdapterUnavailable(str(exc), replica=state.name)
                )
                fut.exception()  # retrieved: waiters get it, nobody logs "never retrieved"
            if isinstance(exc, ReplicaError):
                raise AdapterUnavailable(f"loading '{adapter}' failed: {exc}", replica=state.name) from exc
            raise
        finally:
            self._loading.pop((state.name, adapter), None)

    async def _make_room(self, state: ReplicaState, client: ReplicaClient, adapter: str) -> None:
        others = {a: t for a, t in state.adapters.items() if a != adapter}
        if len(others) < state.max_loras:
            return
        idle = [
            a
            for a in sorted(others, key=lambda a: others[a])
            if state.adapter_inflight.get(a, 0) == 0 and (state.name, a) not in self._loading
        ]
        if not idle:
            raise AdapterUnavailable(f"all {state.max_loras} adapter slots are busy", replica=state.name)
        victim = idle[0]
        try:
            await client.unload_lora_adapter(victim)
        except ReplicaError as exc:
            if exc.status != 404:  # already gone is fine
                raise
        state.adapters.pop(victim, None)
        self.registry.changed(state)
        if self.on_evict is not None:
            self.on_evict(state.name, victim)
