"""The routing framework: Filters -> Producers -> weighted Scorers -> one Picker, grouped in profiles.

The shape is llm-d's endpoint picker (STYLE.md §1-3): a profile narrows the candidates with
filters, lets the producers its scorers consume attach facts to the request's
:class:`~router.types.CycleState` (prefix ring position, approximate cache matches, adapter
slots), sums the scorers' clamped and weighted ``{replica: score in [0, 1]}`` maps, and lets its
picker choose (ties broken by the router's seeded RNG). After the pick, producers update their
indexes. Every plugin call is timed and reported to an optional :class:`RouterObserver` labelled
by extension point, type and name.

Example::

    router = build_router(fleet.router, clock=SystemClock(), seed=7)   # router.loader
    result = router.route(RouteRequest(model="llama", prefix_key=42), views)
    result.replica.name, result.scores, result.notes
"""

from __future__ import annotations

import random
import time
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from router.types import CycleState, ReplicaView, RouteRequest, RouteResult
from tidal.clock import Clock, SystemClock

__all__ = [
    "Filter",
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
    the default profile does.
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
    """Filters, weighted scorers and one picker; producers are derived from what scorers consume."""

    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    picker: Picker | None = None
    producers: list[Producer] = field(default_factory=list)

    def run(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        state: CycleState,
        observer: RouterObserver | None,
        exclude: Container[str] = (),
    ) -> RouteResult | None:
        assert self.picker is not None, f"profile {self.name} has no picker"
        timed = observer is not None
        candidates = [r for r in replicas if r.name not in exclude] if exclude else list(replicas)
        for f in self.filters:
            t0 = time.perf_counter() if timed else 0.0
            candidates = f.filter(request, candidates, state)
            if observer is not None:
                observer.plugin_timed("filter", f.TYPE, f.name, time.perf_counter() - t0)
            if not candidates:
                return None
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
    * ``observer`` -- gets plugin timings and decisions (metrics); ``None`` skips timing.
    """

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        default: str,
        *,
        clock: Clock | None = None,
        seed: int | None = None,
        observer: RouterObserver | None = None,
    ) -> None:
        if default not in profiles:
            raise ValueError(f"default profile '{default}' is not defined (known: {', '.join(profiles)})")
        self.profiles = dict(profiles)
        self.default = default
        self.clock: Clock = clock or SystemClock()
        self.rng = random.Random(seed)
        self.observer = observer

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
        result = prof.run(request, replicas, state, self.observer, exclude)
        if self.observer is not None:
            self.observer.decided(prof.name, result)
        return result

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
