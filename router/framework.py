"""The routing framework: Filters -> Producers -> weighted Scorers -> one Picker, grouped in profiles.

The shape is llm-d's endpoint picker (STYLE.md §1-3): a profile narrows the candidates with
filters, lets the producers its scorers consume attach facts to the request's
:class:`~router.types.CycleState` (prefix ring position, approximate cache matches, adapter
slots), sums the scorers' clamped and weighted ``{replica: score in [0, 1]}`` maps, and lets its
picker choose (ties broken by the router's seeded RNG). After the pick, producers update their
indexes. The plugin calls of a sample of decisions (one in ``time_every``) are timed and
reported to an optional :class:`RouterObserver` labelled by extension point, type and name.

**At pool scale** (a :class:`~router.pool.PoolIndex` of more than ``narrow_above`` replicas) a
profile whose plugins allow it decides without visiting every replica: the filters that read
only what rarely changes (``STATIC``) run once per pool version and are cached, the others
narrow that set (:meth:`NarrowingFilter.narrow`: the canary draw, the capacity cut), and the
producers nominate the replicas worth scoring (:meth:`Nominator.nominate`: the prefix holders,
the ring's targets); with the ``narrow_k`` least loaded candidates they are what the scorers
score. Scorers that score a replica from its own view and the produced facts (``LOCAL``) give
each nominee the score the full scan would; the full scan's winner is picked whenever it is a
nominee, except where a scorer normalises over its candidates (``prefill-cost-scorer``'s range),
which can turn a near-tie.

Example::

    router = build_router(fleet.router, clock=SystemClock(), seed=7)   # router.loader
    result = router.route(RouteRequest(model="llama", prefix_key=42), views)
    result.replica.name, result.scores, result.notes
"""

from __future__ import annotations

import random
import time
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from tidal.clock import Clock, SystemClock
from tidal.router.pool import CANDIDATES, Candidates, PoolCandidates, PoolIndex
from tidal.router.types import CycleState, ReplicaView, RouteRequest, RouteResult

__all__ = [
    "Filter",
    "NarrowingFilter",
    "Nominator",
    "Picker",
    "Plugin",
    "PluginKind",
    "Producer",
    "Profile",
    "Router",
    "RouterObserver",
    "Scorer",
]

PluginKind = Literal["filter", "scorer", "picker", "producer"]


@runtime_checkable
class Plugin(Protocol):
    """Every plugin has a registered ``TYPE``, a ``KIND`` and an instance ``name`` from the config."""

    TYPE: ClassVar[str]
    KIND: ClassVar[PluginKind]
    name: str


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]: ...


@runtime_checkable
class NarrowingFilter(Filter, Protocol):
    """A filter that can also cut a pool-scale candidate set (:class:`~router.pool.PoolCandidates`)
    as :meth:`filter` would cut the list of its views."""

    def narrow(
        self, request: RouteRequest, candidates: PoolCandidates, state: CycleState
    ) -> PoolCandidates: ...


@runtime_checkable
class Nominator(Plugin, Protocol):
    """A producer or scorer that names the replicas it favours, at pool scale (names outside
    the candidates are ignored)."""

    def nominate(self, request: RouteRequest, candidates: Candidates, state: CycleState) -> Iterable[str]: ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    """A pure function of the request, the candidates and the produced facts.

    ``CONSUMES`` names the producer types whose facts it reads; a profile runs exactly those.
    """

    CONSUMES: ClassVar[tuple[str, ...]]

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]: ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(self, scored: Sequence[tuple[ReplicaView, float]], state: CycleState) -> ReplicaView: ...


@runtime_checkable
class Producer(Plugin, Protocol):
    """Gathers facts before the decision and updates its own index after the pick.

    ``replicas`` is every replica of the pool (for structures that must stay stable as replicas
    come and go, like the hash ring); ``candidates`` what the filters left. ``READS_BLOCKS`` says
    it reads :attr:`RouteRequest.prefix_blocks`, which the gateway hashes only when a producer of
    the default profile does. A producer that keeps state per replica also has
    ``forget(replica: str) -> None``, called by :meth:`Router.forget` when a replica leaves.
    """

    READS_BLOCKS: ClassVar[bool]

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None: ...

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None: ...


class RouterObserver(Protocol):
    """Receives the timing of every plugin call and every decision (the gateway's metrics)."""

    def plugin_timed(self, kind: str, type_: str, name: str, seconds: float) -> None: ...

    def decided(self, profile: str, result: RouteResult | None) -> None: ...


@dataclass
class Profile:
    """Filters, weighted scorers and one picker; producers are derived from what scorers consume.

    ``narrow_above`` -- pools larger than this are routed on nominees (see the module doc);
    ``narrow_k`` -- the least loaded candidates scored besides the producers' nominees.
    """

    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    picker: Picker | None = None
    producers: list[Producer] = field(default_factory=list)
    narrow_above: int = 64
    narrow_k: int = 8
    _narrows: bool | None = field(default=None, repr=False)
    _nominators: list[Nominator] = field(default_factory=list, repr=False)

    def narrows(self) -> bool:
        """Whether every plugin allows deciding on nominees: static filters first, then filters
        that narrow, local scorers, a max-score picker, producers that nominate or are local."""
        if self._narrows is None:
            static = [bool(getattr(f, "STATIC", False)) for f in self.filters]
            first_dynamic = static.index(False) if False in static else len(static)
            self._narrows = (
                all(isinstance(f, NarrowingFilter) for f in self.filters[first_dynamic:])
                and not any(static[first_dynamic:])
                and all(getattr(s, "LOCAL", False) for s, _ in self.scorers)
                and bool(getattr(self.picker, "LOCAL", False))
                and all(isinstance(p, Nominator) or getattr(p, "LOCAL", False) for p in self.producers)
            )
            # (a runtime Protocol check costs tens of microseconds: done once, here)
            self._nominators = [
                p for p in (*self.producers, *(s for s, _ in self.scorers)) if isinstance(p, Nominator)
            ]
        return self._narrows

    def run(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        state: CycleState,
        observer: RouterObserver | None,
        exclude: Container[str] = (),
    ) -> RouteResult | None:
        assert self.picker is not None, f"profile {self.name} has no picker"
        if isinstance(replicas, PoolIndex) and len(replicas) > self.narrow_above and self.narrows():
            candidates = self._nominees(request, replicas, state, observer, exclude)
        else:
            candidates = self._filtered(request, replicas, state, observer, exclude)
        if not candidates:
            return None
        return self._decide(request, replicas, candidates, state, observer)

    def _filtered(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        state: CycleState,
        observer: RouterObserver | None,
        exclude: Container[str],
    ) -> list[ReplicaView]:
        timed = observer is not None
        candidates = [r for r in replicas if r.name not in exclude] if exclude else list(replicas)
        for f in self.filters:
            t0 = time.perf_counter() if timed else 0.0
            candidates = f.filter(request, candidates, state)
            if observer is not None:
                observer.plugin_timed("filter", f.TYPE, f.name, time.perf_counter() - t0)
            if not candidates:
                return []
        return candidates

    def _nominees(
        self,
        request: RouteRequest,
        pool: PoolIndex,
        state: CycleState,
        observer: RouterObserver | None,
        exclude: Container[str],
    ) -> list[ReplicaView]:
        timed = observer is not None
        static = [f for f in self.filters if getattr(f, "STATIC", False)]
        t0 = time.perf_counter() if timed else 0.0

        def members() -> tuple[frozenset[str], frozenset[str]]:
            views: list[ReplicaView] = list(pool)
            for f in static:
                views = f.filter(request, views, state)
            inside = frozenset(v.name for v in views)
            return inside, frozenset(pool.names()) - inside

        inside, outside = pool.memo((self.name, request.model, request.adapter, request.regions), members)
        if observer is not None and static:
            observer.plugin_timed("filter", static[0].TYPE, static[0].name, time.perf_counter() - t0)
        cands = PoolCandidates(
            pool,
            inside,
            outside,
            skip_full=False,
            exclude=frozenset(n for n in pool.names() if n in exclude) if exclude else frozenset(),
        )
        for f in self.filters[len(static) :]:
            t0 = time.perf_counter() if timed else 0.0
            cands = f.narrow(request, cands, state)  # type: ignore[attr-defined]  # narrows() checked
            if observer is not None:
                observer.plugin_timed("filter", f.TYPE, f.name, time.perf_counter() - t0)
        if not len(cands):
            return []
        state.put(CANDIDATES, cands)
        chosen: dict[str, ReplicaView] = {v.name: v for v in cands.least_loaded(self.narrow_k)}
        for p in self._nominators:
            t0 = time.perf_counter() if timed else 0.0
            for name in p.nominate(request, cands, state):
                if name not in chosen and (v := cands.view(name)) is not None:
                    chosen[name] = v
            if observer is not None:
                observer.plugin_timed("producer", p.TYPE, p.name, time.perf_counter() - t0)
        return list(chosen.values())

    def _decide(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: list[ReplicaView],
        state: CycleState,
        observer: RouterObserver | None,
    ) -> RouteResult:
        assert self.picker is not None
        timed = observer is not None
        for p in self.producers:
            t0 = time.perf_counter() if timed else 0.0
            p.produce(request, replicas, candidates, state)
            if observer is not None:
                observer.plugin_timed("producer", p.TYPE, p.name, time.perf_counter() - t0)
        totals = dict.fromkeys((c.name for c in candidates), 0.0)
        for scorer, weight in self.scorers:
            t0 = time.perf_counter() if timed else 0.0
            scores = scorer.score(request, candidates, state)
            if observer is not None:
                observer.plugin_timed("scorer", scorer.TYPE, scorer.name, time.perf_counter() - t0)
            for name, s in scores.items():
                if name in totals:
                    # Scores outside [0, 1] are clamped, so one scorer cannot drown the others.
                    totals[name] += (0.0 if s < 0.0 else 1.0 if s > 1.0 else s) * weight
        t0 = time.perf_counter() if timed else 0.0
        picked = self.picker.pick([(c, totals[c.name]) for c in candidates], state)
        if observer is not None:
            observer.plugin_timed("picker", self.picker.TYPE, self.picker.name, time.perf_counter() - t0)
        for p in self.producers:
            p.after_pick(request, picked, state)
        return RouteResult(picked, self.name, totals, state.notes)


class Router:
    """Runs one profile per request over injected replica views.

    **Parameters:**

    * ``profiles`` -- by name; ``default`` -- the one used when a request names none.
    * ``clock`` -- time for producers that age their indexes (default: real monotonic time).
    * ``seed`` -- seeds the RNG that breaks ties and samples (``None``: nondeterministic).
    * ``observer`` -- gets every decision and the plugin timings of one decision in
      ``time_every`` (the first included): timing each plugin call costs about a tenth of a
      decision, and a sample shows the same distribution. ``None`` skips both.
    """

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        default: str,
        *,
        clock: Clock | None = None,
        seed: int | None = None,
        observer: RouterObserver | None = None,
        time_every: int = 8,
    ) -> None:
        if default not in profiles:
            raise ValueError(f"default profile '{default}' is not defined (known: {', '.join(profiles)})")
        self.profiles = dict(profiles)
        self.default = default
        self.clock: Clock = clock or SystemClock()
        self.rng = random.Random(seed)
        self.observer = observer
        self.time_every = max(1, time_every)
        self._decisions = 0

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        *,
        profile: str | None = None,
        exclude: Container[str] = (),
    ) -> RouteResult | None:
        """Pick a replica for ``request`` among ``replicas`` (minus ``exclude``); ``None`` when the
        filters leave no candidate."""
        prof = self.profiles[profile or self.default]
        state = CycleState(request, self.clock.now(), self.rng)
        timing = self.observer if self._decisions % self.time_every == 0 else None
        self._decisions += 1
        result = prof.run(request, replicas, state, timing, exclude)
        if self.observer is not None:
            self.observer.decided(prof.name, result)
        return result

    def forget(self, replica: str) -> None:
        """``replica`` left its pool: every producer that keeps state per replica drops its own
        (what it indexed there would otherwise stay in memory for good, and describe a cache
        that a replica coming back under the name no longer has)."""
        for p in self.producers():
            forget = getattr(p, "forget", None)
            if forget is not None:
                forget(replica)

    def producers(self, profiles: Iterable[str] | None = None) -> list[Producer]:
        """The producers of ``profiles`` (default: every profile), each once: profiles that
        consume the same producer share one instance."""
        out: list[Producer] = []
        for name in self.profiles if profiles is None else profiles:
            out += [p for p in self.profiles[name].producers if all(p is not q for q in out)]
        return out

    def describe(self) -> dict[str, Any]:
        """The profiles and their plugins, for logs and ``/admin`` views."""
        return {
            name: {
                "filters": [f"{f.TYPE}/{f.name}" for f in p.filters],
                "scorers": [{"plugin": f"{s.TYPE}/{s.name}", "weight": w} for s, w in p.scorers],
                "picker": f"{p.picker.TYPE}/{p.picker.name}" if p.picker else None,
                "producers": [f"{x.TYPE}/{x.name}" for x in p.producers],
            }
            for name, p in self.profiles.items()
        }
