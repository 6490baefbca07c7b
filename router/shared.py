"""Load that only gateways know, shared by every gateway process through a store (Redis).

A replica's ``/metrics`` say what it runs, a scrape interval late; only the gateways know what
they have just sent it, what still waits for its first token and how many requests the capped
batch allows. With several gateways (or ``tidal gateway --workers N``) each one sees only its own
share, so the router balances a fraction of the load and every replica takes N x its cap. Here
every gateway process, every ``interval_s``, **publishes** what it has on each replica (requests
in flight, prompt tokens not yet prefilled) and waiting in its admission queue per pool, and
**reads** what every other live gateway published, in one round trip
(:class:`LoadStore`). The registry's views then count all gateways' requests
(:attr:`~router.registry.ReplicaState.remote_inflight`), so the capacity filter, admission's free
slots and every load scorer see the fleet's load.

* **Staleness is bounded and measured.** Another gateway's counts are at most its publication
  age plus the time since this gateway read them (:meth:`SharedLoad.age_s`); each successful
  sync records the oldest the view got before it was refreshed (``on_sync``). With the default
  50 ms interval that is about two intervals plus two round trips. Counts older than ``ttl_s``
  are never used: when the store stays unreachable that long, the view falls back to this
  gateway's own counts (the embedded behaviour) until the store answers again.
* **A dead gateway leaks nothing.** Its published counts expire in the store after ``ttl_s``
  (a gateway that stops cleanly withdraws them at once, :meth:`SharedLoad.leave`).
* **One cap per replica for all gateways.** Each gateway's :class:`~priority.capacity.AdaptiveCap`
  still learns from the TPOT it measures, but a decision (a cut or a step up) is proposed to the
  store with the epoch of the cap it was based on and wins only if nobody decided since (a
  compare-and-set); every other gateway adopts the winner and starts its next interval from it,
  so the fleet runs one AIMD controller per replica, not one per gateway. Its growth test
  ("the cap was reached") reads the in-flight count of all gateways.
* **A slot freed and taken again within one interval stays taken.** A gateway publishes the
  most it had in flight since its previous publication: a closed-loop client's next request
  finds its slot at the same gateway instead of a second gateway grabbing it meanwhile (a slot
  that stays free is seen one interval later).
* **Counters add up across gateways.** A gateway's cumulative counters (``counters``: a canary
  group's requests and errors) go to the store as increments at each sync and come back as the
  fleet's totals (:meth:`SharedLoad.fleet_totals`), which grow however many processes count and
  whichever one is asked, and outlive a process that restarts; an increment a failed sync did
  not deliver goes with the next.
* **The request path does no I/O.** ``acquire``/``release`` change local counters as before;
  publication and reading happen in the background loop (:meth:`SharedLoad.run_forever`).

The cap still binds softly across gateways, as it does within one: two gateways that both see
the last free slot within one staleness bound may both take it.

Example::

    shared = SharedLoad(registry, RedisLoadStore(url, gateway_id="gw-1"), clock=SystemClock(),
                        queue_depth=admission.queue_depth, on_freed=proxy.slot_freed)
    task = asyncio.create_task(shared.run_forever())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tidal.clock import Clock
from tidal.router.registry import ReplicaRegistry

__all__ = [
    "CapProposal",
    "GatewayLoad",
    "LoadStore",
    "SharedCap",
    "SharedLoad",
    "StoreUnavailable",
    "SyncReply",
]

log = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """The shared store did not answer (down, unreachable, timed out)."""


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """What one gateway process has: per replica ``(in flight, prompt tokens not yet prefilled)``
    (replicas with nothing are left out), per pool the requests waiting in its admission queue,
    per ``(pool, tenant)`` the requests it admitted and has not finished (admission's fair share
    counts them pool-wide), per pool ``(requests, errors)`` per second over its recent window (so
    that any one gateway can report the fleet's rates, as the autoscaler reads them)."""

    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)
    tenants: dict[tuple[str, str], int] = field(default_factory=dict)
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SharedCap:
    """A replica's cap as the store holds it; ``epoch`` counts the decisions that set it."""

    value: int
    epoch: int


@dataclass(frozen=True, slots=True)
class CapProposal:
    """This gateway decided ``value`` for ``replica`` from the cap of ``expected_epoch``."""

    replica: str
    expected_epoch: int
    value: int


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The store's answer to one sync: every other live gateway's load and how old it was at the
    store (seconds), the shared caps of the replicas asked about, the proposals that won, and
    the fleet's counter totals (this sync's increments included)."""

    others: dict[str, GatewayLoad]
    ages_s: dict[str, float]
    caps: dict[str, SharedCap]
    accepted: frozenset[str] = frozenset()
    counts: dict[str, int] = field(default_factory=dict)


class LoadStore(Protocol):
    """Where gateways meet. One :meth:`sync` publishes this gateway's load, applies its cap
    proposals (each a compare-and-set on the epoch), adds ``increments`` to the fleet's counters,
    and reads the others' loads, the caps of ``replicas`` and the counters' totals; it raises
    :class:`StoreUnavailable` when the store cannot be reached."""

    gateway_id: str

    async def sync(
        self,
        mine: GatewayLoad,
        proposals: Sequence[CapProposal],
        replicas: Sequence[str],
        increments: Mapping[str, int] | None = None,
    ) -> SyncReply: ...

    async def leave(self) -> None: ...

    async def aclose(self) -> None: ...


class SharedLoad:
    """Keeps the registry's view of other gateways' load fresh (the built-in sync loop).

    **Parameters:** ``registry`` -- whose replicas are published and updated; ``store`` -- the
    :class:`LoadStore`; ``clock``; ``interval_s`` -- between syncs; ``ttl_s`` -- how long a
    gateway's published counts live in the store, and the age past which this gateway stops
    using what it read; ``timeout_s`` -- one sync's limit; ``queue_depth`` -- this gateway's
    admission queue per pool; ``counters`` -- this gateway's cumulative counters by name, added
    up across gateways (:meth:`fleet_totals`); ``on_freed`` -- called with a pool whose other
    gateways freed slots (or whose cap grew), to wake this gateway's waiting requests;
    ``on_sync`` -- called after each successful sync with its duration and the oldest the view
    had grown before it.
    """

    def __init__(
        self,
        registry: ReplicaRegistry,
        store: LoadStore,
        *,
        clock: Clock,
        interval_s: float = 0.05,
        ttl_s: float = 2.0,
        timeout_s: float | None = None,
        queue_depth: Callable[[str], int] | None = None,
        tenant_load: Callable[[], Mapping[tuple[str, str], int]] | None = None,
        pool_rates: Callable[[], Mapping[str, tuple[float, float]]] | None = None,
        counters: Callable[[], Mapping[str, int]] | None = None,
        on_freed: Callable[[str], None] | None = None,
        on_sync: Callable[[float, float | None], None] | None = None,
    ) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError("need 0 < interval_s < ttl_s")
        self.registry = registry
        self.store = store
        self.clock = clock
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s if timeout_s is not None else min(1.0, ttl_s / 2)
        self.queue_depth = queue_depth or (lambda _pool: 0)
        self.tenant_load = tenant_load or dict
        self.pool_rates = pool_rates or dict
        self.counters = counters or dict
        self.on_freed = on_freed
        self.on_sync = on_sync
        self.up = False
        self.gateways = 1  # live gateway processes, this one included
        self.syncs = 0
        self.failures = 0
        self.remote_queued: dict[str, int] = {}
        self.remote_tenants: dict[tuple[str, str], int] = {}  # (pool, tenant) -> the others' count
        self.remote_rates: dict[str, tuple[float, float]] = {}  # pool -> the others' (requests, errors)/s
        self.fleet_counts: dict[str, int] | None = None  # the counters' totals at the last sync
        self._delivered: dict[str, int] = {}  # of this gateway's counters, what the store has
        self._synced_at: float | None = None  # local time the last successful sync started
        self._data_age = 0.0  # the oldest other gateway's publication age at that sync
        self._adopted: dict[str, SharedCap] = {}

    # -- what readers ask --------------------------------------------------------------------------

    def age_s(self, now: float | None = None) -> float:
        """How old, at most, the other gateways' counts in the registry are (inf: none yet)."""
        if self._synced_at is None:
            return math.inf
        return self._data_age + ((self.clock.now() if now is None else now) - self._synced_at)

    def fleet_totals(self) -> dict[str, int] | None:
        """Every counter over every gateway: the totals of the last sync plus what this one
        counted since (``None`` before a first sync). They only grow, however long the store is
        away."""
        if self.fleet_counts is None:
            return None
        counted = self.counters()
        totals = dict(self.fleet_counts)
        for name, n in counted.items():
            totals[name] = totals.get(name, 0) + n - self._delivered.get(name, 0)
        return totals

    # -- one round ---------------------------------------------------------------------------------

    def _mine(self) -> GatewayLoad:
        replicas: dict[str, tuple[int, int]] = {}
        for s in self.registry:
            # A slot freed and taken again within one interval (a client's next request) was never
            # free for the others: publish the peak since the last publication, then the count.
            inflight = max(s.inflight, s.peak_inflight)
            s.peak_inflight = s.inflight
            if inflight or s.prefill_tokens:
                replicas[s.name] = (inflight, s.prefill_tokens)
        queued = {p: n for p in self.registry.pools() if (n := self.queue_depth(p)) > 0}
        tenants = {k: n for k, n in self.tenant_load().items() if n > 0}
        rates = {p: r for p, r in self.pool_rates().items() if r[0] > 0 or r[1] > 0}
        return GatewayLoad(replicas, queued, tenants, rates)

    def _proposals(self) -> list[CapProposal]:
        out = []
        for s in self.registry:
            adopted = self._adopted.get(s.name)
            if adopted is not None and s.cap.value != adopted.value:
                out.append(CapProposal(s.name, adopted.epoch, s.cap.value))
        return out

    async def sync_once(self) -> bool:
        """Publish, read and apply; ``False`` (and local state only, past ``ttl_s``) on failure."""
        started = self.clock.now()
        states = list(self.registry)
        at_start = {s.name: s.cap.value for s in states}
        proposals = self._proposals()
        counted = dict(self.counters())
        increments = {
            k: n - self._delivered.get(k, 0) for k, n in counted.items() if n != self._delivered.get(k, 0)
        }
        try:
            reply = await asyncio.wait_for(
                self.store.sync(self._mine(), proposals, [s.name for s in states], increments), self.timeout_s
            )
        except (StoreUnavailable, TimeoutError) as exc:
            self._failed(started, exc)
            return False
        self._delivered = counted
        self.fleet_counts = reply.counts
        ended = self.clock.now()
        before = self.age_s(ended) if self.up else None
        self.up = True
        self.syncs += 1
        self._synced_at = started
        self._data_age = max(reply.ages_s.values(), default=0.0)
        self.gateways = 1 + len(reply.others)
        self._apply_loads(reply.others)
        self._apply_caps(reply, {p.replica for p in proposals}, at_start)
        if self.on_sync is not None:
            self.on_sync(ended - started, before)
        return True

    def _failed(self, started: float, exc: BaseException) -> None:
        self.failures += 1
        if self.up:
            log.warning("shared load state unavailable (%s); serving on this gateway's counts", exc)
        self.up = False
        if self.age_s(started) > self.ttl_s:
            self._apply_loads({})  # too old to route on: this gateway's own counts only

    def _apply_loads(self, others: dict[str, GatewayLoad]) -> None:
        totals: dict[str, list[int]] = {}
        queued: dict[str, int] = {}
        tenants: dict[tuple[str, str], int] = {}
        rates: dict[str, tuple[float, float]] = {}
        for load in others.values():
            for name, (inflight, prefill) in load.replicas.items():
                t = totals.setdefault(name, [0, 0])
                t[0] += inflight
                t[1] += prefill
            for pool, n in load.queued.items():
                queued[pool] = queued.get(pool, 0) + n
            for key, n in load.tenants.items():
                tenants[key] = tenants.get(key, 0) + n
            for pool, (rps, eps) in load.rates.items():
                r0, e0 = rates.get(pool, (0.0, 0.0))
                rates[pool] = (r0 + rps, e0 + eps)
        freed: set[str] = set()
        for s in self.registry:
            inflight, prefill = totals.get(s.name, (0, 0))
            if inflight < s.remote_inflight:
                freed.add(s.pool)
            s.remote_inflight = inflight
            s.remote_prefill_tokens = prefill
        self.remote_queued = queued
        self.remote_tenants = tenants
        self.remote_rates = rates
        self._wake(freed)

    def _apply_caps(self, reply: SyncReply, proposed: set[str], at_start: dict[str, int]) -> None:
        grown: set[str] = set()
        for s in self.registry:
            remote = reply.caps.get(s.name)
            start_value = at_start.get(s.name)
            if remote is None:
                # Nobody has decided for this replica yet (or the store lost it): keep ours.
                self._adopted.setdefault(
                    s.name, SharedCap(s.cap.value if start_value is None else start_value, 0)
                )
                continue
            adopted = self._adopted.get(s.name)
            if s.name in proposed and s.name in reply.accepted:
                self._adopted[s.name] = remote  # ours won: the store now holds it
                continue
            if adopted is not None and adopted.epoch == remote.epoch:
                continue
            self._adopted[s.name] = remote
            if start_value is not None and s.cap.value != start_value:
                continue  # decided here during the sync: proposed next round, from this epoch
            if remote.value != s.cap.value:
                if remote.value > s.cap.value:
                    grown.add(s.pool)
                s.cap.adopt(remote.value)
        self._wake(grown)

    def _wake(self, pools: set[str]) -> None:
        if self.on_freed is not None:
            for pool in pools:
                self.on_freed(pool)

    # -- the loop ----------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            started = self.clock.now()
            try:
                await self.sync_once()
            except Exception:  # the loop must outlive anything the store or a callback raises
                log.exception("shared load sync failed")
                self._failed(started, RuntimeError("sync raised"))
            await self.clock.sleep(max(0.0, self.interval_s - (self.clock.now() - started)))

    async def leave(self) -> None:
        """Withdraw this gateway's counts at once (a clean stop); best effort."""
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            await asyncio.wait_for(self.store.leave(), self.timeout_s)
