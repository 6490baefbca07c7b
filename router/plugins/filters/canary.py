"""``canary-filter``: split traffic between replica groups (``stable``, ``canary``, ...) by weight.

Replicas with weight 0 get no traffic. When more than one group remains, one group is drawn with
probability proportional to the sum of its replicas' weights (the router's seeded RNG), and only
its replicas stay candidates; so a canary replica at weight 0.05 beside ten stable replicas at
weight 1 takes about 0.5% of requests. No parameters.

Config example::

    - type: canary-filter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.pool import PoolCandidates
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "CanaryFilter"]

TYPE = "canary-filter"


class CanaryFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> CanaryFilter:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        weighted = [r for r in candidates if r.weight > 0]
        groups: dict[str, float] = {}
        for r in weighted:
            groups[r.group] = groups.get(r.group, 0.0) + r.weight
        if len(groups) <= 1:
            return weighted
        chosen = _draw(groups, state)
        return [r for r in weighted if r.group == chosen]

    def narrow(self, request: RouteRequest, candidates: PoolCandidates, state: CycleState) -> PoolCandidates:
        pool = candidates.pool

        def split() -> dict[str, tuple[float, frozenset[str], frozenset[str]]]:
            # Weights and groups are covered by the pool's version, so this is cached with it.
            groups: dict[str, tuple[float, set[str]]] = {}
            for name in candidates.members:
                v = pool.view(name)
                if v is not None and v.weight > 0:
                    w, names = groups.get(v.group, (0.0, set()))
                    names.add(name)
                    groups[v.group] = (w + v.weight, names)
            everyone = frozenset(pool.names())
            return {g: (w, frozenset(n), everyone - n) for g, (w, n) in groups.items()}

        groups = pool.memo((self.TYPE, candidates.members), split)
        if not groups:
            return candidates.narrowed(frozenset(), frozenset(pool.names()))
        chosen = (
            next(iter(groups))
            if len(groups) == 1
            else _draw({g: w for g, (w, _, _) in groups.items()}, state)
        )
        _, inside, outside = groups[chosen]
        return candidates.narrowed(inside, outside)


def _draw(groups: dict[str, float], state: CycleState) -> str:
    """One group, with probability proportional to its weight (the router's seeded RNG)."""
    names = sorted(groups)
    draw = state.rng.random() * sum(groups.values())
    chosen = names[-1]
    for g in names:
        draw -= groups[g]
        if draw < 0:
            chosen = g
            break
    state.notes["group"] = chosen
    return chosen
