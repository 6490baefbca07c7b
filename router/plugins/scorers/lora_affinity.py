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

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from router.framework import PluginKind
from router.plugins.base import PluginParams, parse_params
from router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "LoraAffinityScorer"]

TYPE = "lora-affinity-scorer"


class Params(PluginParams):
    balance_factor: float = Field(default=1.25, ge=1.0, le=100.0)


class LoraAffinityScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> LoraAffinityScorer:
        return cls(name, parse_params(Params, TYPE, name, params))

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        adapter = request.adapter
        if adapter is None or not candidates:
            return {}
        total = sum(c.load for c in candidates)
        bound = math.ceil(self.params.balance_factor * (total + 1) / len(candidates))
        scores: dict[str, float] = {}
        for c in candidates:
            if adapter in c.loaded_adapters:
                scores[c.name] = 1.0 if c.load + 1 <= bound else 0.2
            elif len(c.loaded_adapters) < c.max_loras:
                scores[c.name] = 0.3
            else:
                scores[c.name] = 0.1
        return scores
