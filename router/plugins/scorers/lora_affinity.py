"""``lora-affinity-scorer``: prefer replicas that hold the request's LoRA adapter; load it
elsewhere only when those are too busy.

Scores, for a request naming an adapter (GIE's lora-affinity scorer, plus a load bound):

* 1.0 -- holds the adapter and its load + 1 fits ``ceil(balance_factor * (total + 1) / n)``;
* 0.3 -- has a free adapter slot (loading costs no eviction);
* 0.2 -- holds the adapter but is over the bound (so a free slot elsewhere wins);
* 0.1 -- every slot taken: loading means evicting its least recently used idle adapter.

Requests without an adapter get no scores. Parameters: ``balance_factor`` (default 1.25).

Config example::

    - type: lora-affinity-scorer
      parameters: {balance_factor: 1.5}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.pool import CANDIDATES, Candidates, PoolCandidates
from tidal.router.ring import load_bound
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "LoraAffinityScorer"]

TYPE = "lora-affinity-scorer"


class Params(PluginParams):
    balance_factor: float = Field(default=1.25, ge=1.0, le=100.0)


class LoraAffinityScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    LOCAL: ClassVar[bool] = True  # the bound is over every candidate
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> LoraAffinityScorer:
        return cls(name, parse_params(Params, TYPE, name, params))

    def nominate(self, request: RouteRequest, candidates: Candidates, state: CycleState) -> Iterable[str]:
        """The replicas holding the request's adapter."""
        adapter = request.adapter
        if adapter is None or not isinstance(candidates, PoolCandidates):
            return ()
        pool = candidates.pool
        return pool.memo(
            (self.TYPE, adapter), lambda: frozenset(v.name for v in pool if adapter in v.loaded_adapters)
        )

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        adapter = request.adapter
        if adapter is None or not candidates:
            return {}
        every = state.get(CANDIDATES)  # every candidate, when only some are scored
        if every is not None:
            bound = load_bound(every.total_load(), len(every), self.params.balance_factor)
        else:
            bound = load_bound(sum(c.load for c in candidates), len(candidates), self.params.balance_factor)
        scores: dict[str, float] = {}
        for c in candidates:
            if adapter in c.loaded_adapters:
                scores[c.name] = 1.0 if c.load + 1 <= bound else 0.2
            elif len(c.loaded_adapters) < c.max_loras:
                scores[c.name] = 0.3
            else:
                scores[c.name] = 0.1
        return scores
