"""``cache-aware-scorer``: SGLang's ``cache_aware`` policy as one scorer over the ``radix-tree``.

1. If the load is imbalanced -- ``max - min > balance_abs_threshold`` **and**
   ``max > min * balance_rel_threshold`` over the gateway's in-flight counts -- score 1 for the
   least loaded replicas (shortest queue) and 0 for the rest.
2. Else, if the best prefix match rate exceeds ``cache_threshold``, 1 for the best match.
3. Else 1 for the replica with the smallest tree (spread new prefixes).

Parameters (SGLang's defaults): ``cache_threshold`` (0.3), ``balance_abs_threshold`` (64),
``balance_rel_threshold`` (1.5).

Config example::

    - type: cache-aware-scorer
      parameters: {cache_threshold: 0.5, balance_abs_threshold: 32}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.producers.block_index import TREE_FACTS, TREE_TYPE
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "CacheAwareScorer"]

TYPE = "cache-aware-scorer"


class Params(PluginParams):
    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    balance_abs_threshold: float = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1.0)


class CacheAwareScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = (TREE_TYPE,)

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> CacheAwareScorer:
        return cls(name, parse_params(Params, TYPE, name, params))

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        if not candidates:
            return {}
        p = self.params
        loads = {c.name: c.inflight for c in candidates}
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            state.notes["cache_aware"] = "imbalanced"
            return {n: 1.0 if v == lo else 0.0 for n, v in loads.items()}
        facts = state.get(TREE_FACTS)
        if facts is None:
            return {}
        best = max(facts.match.values(), default=0.0)
        if best > p.cache_threshold:
            state.notes["cache_aware"] = "match"
            return {n: 1.0 if m == best else 0.0 for n, m in facts.match.items()}
        state.notes["cache_aware"] = "smallest_tree"
        smallest = min(facts.size.values(), default=0)
        return {n: 1.0 if s == smallest else 0.0 for n, s in facts.size.items()}
