"""``prefill-cost-scorer``: prefer the replica where the request's first token comes soonest,
counting what its cache saves and what staying there keeps for the next turns.

TTFT is set by the prefill work ahead of a request plus its own uncached prompt, so the cost of
sending it to a candidate is, in tokens::

    cost = queued_prefill x uncached_share + prompt - affinity x cached + per_request x in_flight
           + eviction x uncached x (1 - tail_age / oldest_tail_age)

``queued_prefill`` is the gateway's count of prompt tokens still waiting for their first token
there (:class:`~router.types.ReplicaView`), scaled by the share of recent prompts there that
were not cached (``kv-index``: a replica busy with cached follow-ups has less work queued than
its prompt count says), ``cached`` what the ``kv-index`` believes the replica holds of this
prompt, ``in_flight`` its request count (decodes share every step with the
prefill). ``affinity`` > 1 values a cached prefix above the tokens it saves now: a conversation
that stays where its history is keeps hitting there, while one that moves duplicates its history
on a second replica and evicts someone else's. The last term is what the uncached tokens
evict: nothing on a replica whose cache is not full, the most on the one whose least recently
used block is youngest (``kv-index`` tail age: its cache turns over fastest), so that the
replicas' caches age alike, as one cache of their joint size would. A cold prompt (cached nowhere) thus goes to a replica that is not busy and whose
cache is stale; a later turn follows its prefix unless that replica's queue is longer than what
the cache saves. Scores are ``(worst - cost) / (worst - best)``: 1 for the cheapest, 0 for the
dearest; the decision's notes say ``prefill_cost``: ``cached`` when the cheapest replica holds
part of the prompt, else ``cold``.

Parameters: ``affinity`` (6), ``per_request_tokens`` (64), ``eviction`` (0.5).

Config example::

    - type: prefill-cost-scorer
      parameters: {affinity: 2.0}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.producers.kv_index import CACHED_TOKENS, KV_INDEX_TYPE, TAIL_AGE, UNCACHED_SHARE
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "PrefillCostScorer", "prefill_costs"]

TYPE = "prefill-cost-scorer"


class Params(PluginParams):
    affinity: float = Field(default=6.0, ge=0.0, le=100.0)
    per_request_tokens: float = Field(default=64.0, ge=0.0)
    eviction: float = Field(default=0.5, ge=0.0, le=100.0)


def prefill_costs(
    request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState, params: Params
) -> dict[str, float]:
    """The cost, in prefill tokens, of sending ``request`` to each candidate (see module doc)."""
    cached = state.get(CACHED_TOKENS) or {}
    ages = state.get(TAIL_AGE) or {}
    share = state.get(UNCACHED_SHARE) or {}
    oldest = max(ages.values(), default=math.inf)
    tokens = request.prompt_tokens
    out: dict[str, float] = {}
    affinity, per_request, eviction = params.affinity, params.per_request_tokens, params.eviction
    isinf, inf = math.isinf, math.inf
    for c in candidates:
        name = c.name
        hit = min(tokens, cached.get(name, 0))
        age = ages.get(name, inf)
        # inf: room left, nothing evicted; an equal age everywhere: no replica is the better victim.
        pressure = 0.0 if isinf(age) or oldest <= 0 else 1.0 - age / oldest
        out[name] = (
            c.prefill_tokens * share.get(name, 1.0)
            + tokens
            - affinity * hit
            + per_request * c.load
            + eviction * (tokens - hit) * pressure
        )
    return out


class PrefillCostScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    LOCAL: ClassVar[bool] = True  # but its range is the scored candidates'
    CONSUMES: ClassVar[tuple[str, ...]] = (KV_INDEX_TYPE,)

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> PrefillCostScorer:
        return cls(name, parse_params(Params, TYPE, name, params))

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        costs = prefill_costs(request, candidates, state, self.params)
        if not costs:
            return {}
        cached = state.get(CACHED_TOKENS) or {}
        top = min(costs, key=costs.__getitem__)
        state.notes["prefill_cost"] = "cached" if cached.get(top, 0) > 0 else "cold"
        best, worst = costs[top], max(costs.values())
        if worst <= best:
            return dict.fromkeys(costs, 1.0)
        return {n: (worst - c) / (worst - best) for n, c in costs.items()}
