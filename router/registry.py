"""The replica registry: every replica the gateway may route to, with its live state.

Per replica it keeps what the admin API sets (healthy, draining, canary weight), what the proxy
counts (in-flight requests, the adaptive cap, adapters loaded and their use), what the scraper
brings (the last ``/metrics`` snapshot and when), and the handles of in-flight requests so that
marking a replica unhealthy can fail them fast. With several gateways sharing load state
(:mod:`router.shared`), ``remote_inflight`` and ``remote_prefill_tokens`` hold the other gateways'
counts, and the views, free slots and the cap's growth test count them too; without sharing they
stay 0 and the registry is this gateway's alone. The router sees it only through
:class:`~router.types.ReplicaView` snapshots; admission only through :meth:`free_slots`.

The gateway fills it from the fleet config and the admin API; the routing benchmark fills it with
simulated replicas (``client=None``) and drives the same methods in virtual time.

Example::

    registry = ReplicaRegistry.from_fleet(fleet, clock)
    views = registry.views("interactive")
    state = registry.get(result.replica.name)
    registry.acquire(state); ...; registry.release(state, tpot_s=0.031)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tidal.clock import Clock
from tidal.fleet import FleetConfig, PoolSpec
from tidal.priority.capacity import AdaptiveCap
from tidal.replicas.metrics import LoadSnapshot
from tidal.router.pool import PoolIndex
from tidal.router.types import ReplicaView

if TYPE_CHECKING:
    from tidal.router.kv_events import ReplicaBlockIndex

__all__ = ["Abortable", "ReplicaRegistry", "ReplicaState"]


class Abortable(Protocol):
    """An in-flight request that can be failed fast (its upstream connection closed)."""

    def abort(self, reason: str) -> None: ...


# What a view shows: writing one of these marks the replica's view for rebuilding.
_VIEWED = frozenset(
    (
        "pool",
        "model",
        "group",
        "weight",
        "max_loras",
        "region",
        "healthy",
        "draining",
        "inflight",
        "prefill_tokens",
        "remote_inflight",
        "remote_prefill_tokens",
        "snapshot",
        "snapshot_at",
        "finished_since_snapshot",
        "removed",
        "kv_events",
    )
)
# Of those, the ones that move only load: writing them cannot change what the filters read.
_LOAD = frozenset(
    (
        "inflight",
        "prefill_tokens",
        "remote_inflight",
        "remote_prefill_tokens",
        "snapshot_at",
        "finished_since_snapshot",
    )
)


@dataclass(eq=False)
class ReplicaState:
    """One replica's live state (mutable; the router gets frozen views of it).

    Every write to a field the view shows tells the replica's pool index (:mod:`router.pool`),
    which rebuilds the view before the next decision; a change the setter cannot see (the cap's
    value, the ``adapters`` dict) is reported with :meth:`ReplicaRegistry.changed`.
    """

    name: str
    url: str
    pool: str
    model: str
    cap: AdaptiveCap
    group: str = "stable"
    weight: float = 1.0
    max_loras: int = 0
    region: str | None = None  # its pool's
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    prefill_tokens: int = 0  # prompt tokens of in-flight requests without a first token yet
    remote_inflight: int = 0  # other gateways' requests here (shared load state, see router.shared)
    remote_prefill_tokens: int = 0
    # The most in flight here since the last publication (router.shared publishes it, so that a
    # slot this gateway frees and takes again before its next publication never looks free).
    peak_inflight: int = 0
    snapshot: LoadSnapshot | None = None
    snapshot_at: float | None = None
    finished_since_snapshot: int = 0  # requests released here since ``snapshot`` was taken
    adapters: dict[str, float] = field(default_factory=dict)  # adapter -> last use (LRU order)
    adapter_inflight: Counter[str] = field(default_factory=Counter)
    handles: set[Abortable] = field(default_factory=set)
    client: Any = None  # the gateway's pooled ReplicaClient; None for simulated replicas
    requests: int = 0
    errors: int = 0
    removed: bool = False
    kv_events: ReplicaBlockIndex | None = None  # its exact KV index, when it publishes events
    index: PoolIndex | None = field(default=None, repr=False)
    clock: Clock | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEWED:
            index = self.__dict__.get("index")
            if index is not None:
                index.changed(self, load_only=name in _LOAD)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.weight > 0 and not self.removed

    def view(self) -> ReplicaView:
        snap = self.snapshot
        adapters = frozenset(self.adapters) if self.adapters else _NO_ADAPTERS
        if snap is not None and (snap.running_lora_adapters or snap.waiting_lora_adapters):
            adapters |= snap.running_lora_adapters | snap.waiting_lora_adapters
        # Positional, in ReplicaView's field order: a view is rebuilt after every request's start
        # and end, and keywords cost a fifth of its construction.
        return ReplicaView(
            self.name,
            self.pool,
            self.model,
            self.group,
            self.weight,
            self.healthy,
            self.draining,
            self.inflight + self.remote_inflight,  # inflight
            self.cap.value,  # cap
            snap,
            self.snapshot_at if snap is not None else None,
            adapters,  # loaded_adapters
            self.max_loras,
            self.prefill_tokens + self.remote_prefill_tokens,  # prefill_tokens
            self.finished_since_snapshot,
            self.region,
            self.kv_events,
            self.clock,
        )


_NO_ADAPTERS: frozenset[str] = frozenset()


class ReplicaRegistry:
    """All replicas, by name and by pool."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._by_name: dict[str, ReplicaState] = {}
        self._by_pool: dict[str, list[ReplicaState]] = {}
        self._index: dict[str, PoolIndex] = {}

    @staticmethod
    def new_cap(pool: PoolSpec, slo_s: float, clock: Clock) -> AdaptiveCap:
        return AdaptiveCap(
            pool.max_inflight_per_replica,
            minimum=pool.min_inflight_per_replica,
            maximum=pool.max_inflight_per_replica,
            slo_s=slo_s,
            clock=clock,
        )

    @classmethod
    def from_fleet(cls, fleet: FleetConfig, clock: Clock) -> ReplicaRegistry:
        """Every replica of every pool in the config, with its cap adapting to the strictest
        TPOT SLO among the classes (the interactive one)."""
        reg = cls(clock)
        slo = min(c.tpot_slo_s for c in fleet.classes.values())
        for pool in fleet.pools.values():
            reg._by_pool.setdefault(pool.name, [])
            for r in pool.replicas:
                reg.add(
                    ReplicaState(
                        name=r.name,
                        url=r.base_url,
                        pool=pool.name,
                        model=pool.model,
                        cap=cls.new_cap(pool, slo, clock),
                        group=r.group,
                        weight=r.weight,
                        max_loras=r.max_loras,
                        region=pool.region,
                    )
                )
        return reg

    # -- membership ------------------------------------------------------------------------------

    def add(self, state: ReplicaState) -> ReplicaState:
        if state.name in self._by_name:
            raise KeyError(f"replica '{state.name}' already exists")
        self._by_name[state.name] = state
        self._by_pool.setdefault(state.pool, []).append(state)
        state.clock = self.clock
        index = self._pool_index(state.pool)
        index.add(state)
        state.index = index
        return state

    def remove(self, name: str) -> ReplicaState:
        state = self._by_name.pop(name)
        state.removed = True
        self._by_pool[state.pool] = [s for s in self._by_pool[state.pool] if s is not state]
        if state.index is not None:
            state.index.remove(state)
            state.index = None
        return state

    def _pool_index(self, pool: str) -> PoolIndex:
        index = self._index.get(pool)
        if index is None:
            index = self._index[pool] = PoolIndex(pool)
        return index

    def changed(self, state: ReplicaState, *, load_only: bool = False) -> None:
        """Something the setter cannot see changed (the cap's value, the adapters loaded);
        ``load_only``: nothing the filters read (the cap's value, after a request)."""
        if state.index is not None:
            state.index.changed(state, load_only=load_only)

    def get(self, name: str) -> ReplicaState | None:
        return self._by_name.get(name)

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def pools(self) -> list[str]:
        return list(self._by_pool)

    def in_pool(self, pool: str) -> list[ReplicaState]:
        return self._by_pool.get(pool, [])

    # -- what routing and admission read ----------------------------------------------------------

    def views(self, pool: str) -> PoolIndex:
        """The pool's views, current: those of replicas that changed are rebuilt, no others."""
        return self._pool_index(pool).refresh()

    def over_cap(self, pool: str) -> int:
        return sum(
            max(0, s.inflight + s.remote_inflight - s.cap.value)
            for s in self._by_pool.get(pool, ())
            if s.routable
        )

    def free_slots(self, pool: str) -> int:
        return sum(
            max(0, s.cap.value - s.inflight - s.remote_inflight)
            for s in self._by_pool.get(pool, ())
            if s.routable
        )

    # -- what the proxy and the scraper write ------------------------------------------------------

    def acquire(self, state: ReplicaState, adapter: str | None = None, prompt_tokens: int = 0) -> None:
        """A request starts on ``state``; its ``prompt_tokens`` count as pending prefill until
        :meth:`first_token` (or :meth:`release`) says otherwise."""
        state.inflight += 1
        if state.inflight > state.peak_inflight:
            state.peak_inflight = state.inflight
        state.prefill_tokens += prompt_tokens
        state.requests += 1
        state.cap.note_inflight(state.inflight + state.remote_inflight)
        if adapter is not None:
            state.adapter_inflight[adapter] += 1
            if adapter in state.adapters:  # LRU touch; loading is the adapter manager's job
                state.adapters[adapter] = self.clock.now()
        self.changed(state, load_only=True)  # the cap may have moved

    def first_token(self, state: ReplicaState, prompt_tokens: int) -> None:
        """The request's prefill is done: its prompt no longer counts as pending work."""
        state.prefill_tokens = max(0, state.prefill_tokens - prompt_tokens)

    def release(
        self,
        state: ReplicaState,
        *,
        adapter: str | None = None,
        tpot_s: float | None = None,
        failed: bool = False,
        pending_prompt_tokens: int = 0,
    ) -> None:
        """A request ended; ``pending_prompt_tokens`` is its prompt if it never got a first token."""
        state.inflight = max(0, state.inflight - 1)
        state.finished_since_snapshot += 1
        state.prefill_tokens = max(0, state.prefill_tokens - pending_prompt_tokens)
        if failed:
            state.errors += 1
        if adapter is not None:
            state.adapter_inflight[adapter] -= 1
            if state.adapter_inflight[adapter] <= 0:
                del state.adapter_inflight[adapter]
        if tpot_s is not None:
            state.cap.observe(tpot_s)
        else:
            state.cap.maybe_decide()
        self.changed(state, load_only=True)  # the cap may have moved

    def update_snapshot(self, name: str, snapshot: LoadSnapshot) -> None:
        state = self._by_name.get(name)
        if state is not None:
            state.snapshot = snapshot
            state.snapshot_at = self.clock.now()
            state.finished_since_snapshot = 0
