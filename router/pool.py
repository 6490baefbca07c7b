"""A pool's replicas as the router reads them, kept current as their state changes.

The registry keeps one :class:`PoolIndex` per pool. It holds a :class:`~router.types.ReplicaView`
per replica and rebuilds a view only when that replica's state changed (a request started or
ended, a scrape, a health or admin change: :class:`~router.registry.ReplicaState` reports every
write), so a decision never rebuilds the pool. It also keeps what lets a profile decide without
visiting every replica (:meth:`router.framework.Profile.run` at pool scale):

* the replicas in load order (in-flight requests, then queued prefill tokens), so the least
  loaded come first without a scan;
* the names of replicas at their in-flight cap, and the pool's totals of load and prefill tokens,
  so a ring's bound is the same mean as over every candidate;
* the names of replicas whose views carry a KV-event index (``publishing``), so a producer
  finds one without a scan;
* ``version``, which moves when anything the filters read changes (health, weights, groups,
  adapters, membership) and not when load does: filter results are cached under it
  (:meth:`memo`).

The load order and the totals are brought up to date when read, not when a view is rebuilt:
small pools, routed over every candidate, never read them and do not pay for them.

:class:`Candidates` is one decision's candidate set, either a plain list of views (small pools,
tests) or a pool's filtered members named by sets (pool scale); ring producers walk it and read
its totals, the same code in both cases.

Example::

    pool = registry.views("interactive")        # a PoolIndex: a sequence of views
    pool.refresh()                               # rebuilds what changed since the last decision
    [v.name for v in itertools.islice(pool.least_loaded(), 4)]
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from itertools import filterfalse
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar, overload

from sortedcontainers import SortedList

from tidal.router.types import ReplicaView, StateKey

_NAME = itemgetter(2)  # the name in an order key

if TYPE_CHECKING:
    from tidal.router.registry import ReplicaState

__all__ = ["CANDIDATES", "Candidates", "PoolCandidates", "PoolIndex", "ViewCandidates"]

T = TypeVar("T")

_MEMO_MAX = 256  # filter results kept per version (distinct models, adapters, regions)


def _membership(v: ReplicaView) -> tuple[Any, ...]:
    """What filters read of a view, other than load."""
    return (v.healthy, v.draining, v.weight, v.group, v.model, v.region, v.max_loras, v.loaded_adapters)


def _order_key(v: ReplicaView) -> tuple[float, int, str]:
    return (v.load, v.prefill_tokens, v.name)


class PoolIndex(Sequence[ReplicaView]):
    """The views of one pool's replicas, rebuilt per replica on change (see the module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._states: list[ReplicaState] = []
        self._views: list[ReplicaView] = []
        self._slot: dict[str, int] = {}
        # Slots whose state changed since their view was built -> whether what the filters read
        # may have changed too (not after a write that moves only load).
        self._dirty: dict[int, bool] = {}
        self._order: SortedList = SortedList()
        self._counted: dict[str, tuple[float, int, str]] = {}
        self._uncounted: dict[str, None] = {}  # names whose current view is not counted yet
        self._full: set[str] = set()  # at or over their in-flight cap
        self._publishing: dict[str, None] = {}  # whose views carry a KV-event index (in order)
        self._prefill_total = 0
        self._load_total = 0.0
        self.version = 0  # what filters read (see _membership), or who is in the pool, changed
        self.names_version = 0  # who is in the pool changed
        self._memo: dict[Hashable, Any] = {}
        self._memo_version = -1

    # -- membership (the registry) ------------------------------------------------------------------

    def add(self, state: ReplicaState) -> None:
        self._slot[state.name] = len(self._states)
        self._states.append(state)
        self._views.append(state.view())
        self._uncounted[state.name] = None
        self.version += 1
        self.names_version += 1

    def remove(self, state: ReplicaState) -> None:
        slot = self._slot.pop(state.name)
        self._uncounted.pop(state.name, None)
        self._uncount(state.name)
        self._dirty.pop(slot, None)
        last = len(self._states) - 1
        if slot != last:  # the last one moves into the hole
            moved = self._states[last]
            self._states[slot] = moved
            self._views[slot] = self._views[last]
            self._slot[moved.name] = slot
            if last in self._dirty:
                self._dirty[slot] = self._dirty.pop(last)
        self._states.pop()
        self._views.pop()
        self.version += 1
        self.names_version += 1

    def changed(self, state: ReplicaState, *, load_only: bool = False) -> None:
        """``state`` was written: its view is rebuilt at the next :meth:`refresh`; ``load_only``:
        the write moved only load (the filters' cached results stand without a check)."""
        slot = self._slot.get(state.name)
        if slot is not None and self._states[slot] is state:
            dirty = self._dirty
            dirty[slot] = dirty.get(slot, False) or not load_only

    def refresh(self) -> PoolIndex:
        """Rebuild the views of the replicas that changed; returns ``self``."""
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            views, states, uncounted = self._views, self._states, self._uncounted
            for slot, membership in dirty.items():
                old = views[slot]
                new = views[slot] = states[slot].view()
                uncounted[new.name] = None
                if membership and _membership(old) != _membership(new):
                    self.version += 1
        return self

    def _count(self) -> None:
        """Bring the load order and the totals up to the current views (what :meth:`refresh`
        rebuilt since they were last read)."""
        if not self._uncounted:
            return
        uncounted, self._uncounted = self._uncounted, {}
        views, slot = self._views, self._slot
        for name in uncounted:
            self._uncount(name)
            new = views[slot[name]]
            key = _order_key(new)
            self._counted[name] = key
            self._order.add(key)
            self._load_total += key[0]
            self._prefill_total += key[1]
            if new.inflight >= new.cap:
                self._full.add(name)
            if new.kv_events is not None:
                self._publishing[name] = None

    def _uncount(self, name: str) -> None:
        # What was counted is kept: a view's load can change with time (a snapshot going stale).
        key = self._counted.pop(name, None)
        if key is not None:
            self._order.remove(key)
            self._load_total -= key[0]
            self._prefill_total -= key[1]
            self._full.discard(name)
            self._publishing.pop(name, None)

    @property
    def full(self) -> set[str]:
        """The names of replicas at or over their in-flight cap (read only)."""
        self._count()
        return self._full

    @property
    def publishing(self) -> Mapping[str, None]:
        """The names of replicas whose views carry a KV-event index, in order (read only)."""
        self._count()
        return self._publishing

    @property
    def load_total(self) -> float:
        self._count()
        return self._load_total

    @property
    def prefill_total(self) -> int:
        self._count()
        return self._prefill_total

    # -- reading (the router) -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> ReplicaView: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ReplicaView]: ...

    def __getitem__(self, i: int | slice) -> ReplicaView | Sequence[ReplicaView]:
        return self._views[i]

    def __iter__(self) -> Iterator[ReplicaView]:
        return iter(self._views)

    def view(self, name: str) -> ReplicaView | None:
        slot = self._slot.get(name)
        return self._views[slot] if slot is not None else None

    def names(self) -> tuple[str, ...]:
        return tuple(self._slot)

    def order_key(self, name: str) -> tuple[float, int, str]:
        """Where ``name`` stands in :meth:`least_loaded` (load, queued prefill tokens, name) as
        last counted."""
        self._count()
        return self._counted[name]

    @property
    def order_keys(self) -> Mapping[str, tuple[float, int, str]]:
        """:meth:`order_key` of every replica, as a mapping (read only; its ``__getitem__`` is a
        sort key at C speed)."""
        self._count()
        return self._counted

    def least_loaded(self) -> Iterator[ReplicaView]:
        """Every replica, least loaded first (fewest requests, then fewest queued prefill tokens)."""
        self._count()
        views, slot = self._views, self._slot
        for _, _, name in self._order:
            yield views[slot[name]]

    def names_by_load(self) -> Iterator[str]:
        """The names in :meth:`least_loaded`'s order, at C speed (for ``filter`` and ``islice``)."""
        self._count()
        return map(_NAME, self._order)

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, cached until :attr:`version` moves (for results that depend only on what
        filters read)."""
        if self._memo_version != self.version:
            self._memo.clear()
            self._memo_version = self.version
        try:
            value: T = self._memo[key]
        except KeyError:
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            value = self._memo[key] = compute()
        return value


# -- one decision's candidates ----------------------------------------------------------------------


class Candidates:
    """The replicas that passed a decision's filters, without listing them.

    ``ring_key`` and :meth:`pool_names` name the whole pool (a hash ring covers every replica,
    candidates or not, so a replica filtered out for a moment does not move other keys).
    """

    ring_key: Hashable

    def __contains__(self, name: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def view(self, name: str) -> ReplicaView | None:
        """The candidate's view; ``None`` when ``name`` is not a candidate."""
        raise NotImplementedError

    def total_prefill(self) -> float:
        raise NotImplementedError

    def total_load(self) -> float:
        raise NotImplementedError

    def pool_names(self) -> Iterable[str]:
        raise NotImplementedError


class ViewCandidates(Candidates):
    """Candidates given as a list of views (every decision below pool scale)."""

    def __init__(self, candidates: Sequence[ReplicaView], replicas: Sequence[ReplicaView]) -> None:
        self._by_name = {c.name: c for c in candidates}
        self._replicas = replicas
        self._prefill: float | None = None  # the total, once asked (both rings ask)
        if isinstance(replicas, PoolIndex):
            self.ring_key: Hashable = (id(replicas), replicas.names_version)
        else:
            self.ring_key = tuple(r.name for r in replicas)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def view(self, name: str) -> ReplicaView | None:
        return self._by_name.get(name)

    def total_prefill(self) -> float:
        if self._prefill is None:
            self._prefill = sum(c.prefill_tokens for c in self._by_name.values())
        return self._prefill

    def total_load(self) -> float:
        return sum(c.load for c in self._by_name.values())

    def pool_names(self) -> Iterable[str]:
        return (r.name for r in self._replicas)


class PoolCandidates(Candidates):
    """A pool's members that passed the filters (``members``, from a cache), less those at their
    cap when ``skip_full`` (the capacity filter), less ``exclude`` (replicas already tried)."""

    def __init__(
        self,
        pool: PoolIndex,
        members: frozenset[str],
        outsiders: frozenset[str],
        *,
        exclude: frozenset[str] = frozenset(),
        skip_full: bool = False,
    ) -> None:
        self.pool = pool
        self.members = members
        self.outsiders = outsiders  # the pool's replicas that are not members
        self.exclude = exclude
        self.skip_full = skip_full
        out = exclude | pool.full if skip_full else exclude
        self._out = out & members if out else out
        self.ring_key = (id(pool), pool.names_version)

    def narrowed(self, members: frozenset[str], outsiders: frozenset[str]) -> PoolCandidates:
        """The same cut (exclusions, full replicas) of other members."""
        return PoolCandidates(self.pool, members, outsiders, exclude=self.exclude, skip_full=self.skip_full)

    def without_full(self) -> PoolCandidates:
        """Less the replicas at their in-flight cap."""
        return PoolCandidates(self.pool, self.members, self.outsiders, exclude=self.exclude, skip_full=True)

    def __contains__(self, name: object) -> bool:
        return name in self.members and name not in self._out

    def among(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` that are candidates, in their order (at C speed)."""
        inside = list(filter(self.members.__contains__, names))
        return list(filterfalse(self._out.__contains__, inside)) if self._out else inside

    def __len__(self) -> int:
        return len(self.members) - len(self._out)

    def view(self, name: str) -> ReplicaView | None:
        return self.pool.view(name) if name in self else None

    def _total(self, field: Callable[[ReplicaView], float], pool_total: float) -> float:
        pool = self.pool
        if len(self.members) * 2 <= len(pool):
            return sum(field(v) for n in self.members if n not in self._out and (v := pool.view(n)))
        away = self.outsiders | self._out
        return pool_total - sum(field(v) for n in away if (v := pool.view(n)))

    def total_prefill(self) -> float:
        return self._total(lambda v: v.prefill_tokens, self.pool.prefill_total)

    def total_load(self) -> float:
        return self._total(lambda v: v.load, self.pool.load_total)

    def pool_names(self) -> Iterable[str]:
        return self.pool.names()

    def least_loaded(self, k: int) -> list[ReplicaView]:
        """The ``k`` least loaded candidates."""
        out: list[ReplicaView] = []
        if len(self) <= 4 * k:
            views = [v for n in self.members if n not in self._out and (v := self.pool.view(n))]
            views.sort(key=_order_key)
            return views[:k]
        for v in self.pool.least_loaded():
            if v.name in self:
                out.append(v)
                if len(out) >= k:
                    break
        return out


CANDIDATES: StateKey[Candidates] = StateKey("candidates")
