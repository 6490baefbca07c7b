"""``prefix-ring`` and ``session-ring``: bounded-load consistent hashing of a request key.

Both place the pool's replicas on a hash ring (``virtual_nodes`` points each) and walk it from
the request key's position to the first candidate whose load stays within ``balance_factor``
(c, default 1.25) times the average:

* **load in work** (when the request's prompt size is known, the gateway's case): the prefill
  tokens the request would find queued on the replica (the gateway's count of prompt tokens
  still waiting for their first token) plus its own tokens not cached there; a key stays
  unless that exceeds c x the candidates' mean. Request counts are a poor load unit when one
  prompt is 200 tokens and the next 30,000, and TTFT is set by the prefill work ahead;
* **load in requests** otherwise: in-flight (or scraped running + waiting, when higher) + 1
  within ``ceil(c * (total + 1) / n)``, the classic bound.

A key is also remembered where it was last sent (``follow_memory`` keys, ``follow_ttl_s``): when
its ring replica was over the bound or full, the next request of the same conversation starts
its walk where its prefix now is, instead of going back to a replica that lacks the newest turns.
The result (target, home, walks) goes into the cycle state for
:mod:`~router.plugins.scorers.prefix_affinity` and
:mod:`~router.plugins.scorers.session_affinity`; after the pick the notes say whether the request
stayed on its ring replica (``hit``), followed its prefix elsewhere (``followed``), walked, or
went elsewhere (``miss``).

* ``prefix-ring`` hashes the stable prompt prefix (:mod:`router.prefix`);
* ``session-ring`` hashes ``X-Session-Id`` or the request's ``user``.

Parameters: ``virtual_nodes`` (default 200), ``balance_factor`` (default 1.25, the c in c x
average), ``follow_memory`` (keys remembered, default 100,000; 0 turns following off),
``follow_ttl_s`` (default 900).

Config example::

    - type: prefix-ring
      parameters: {virtual_nodes: 200, balance_factor: 1.25}
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from router.framework import PluginKind
from router.plugins.base import PluginParams, parse_params
from router.ring import BoundedChoice, HashRing, bounded_choice, bounded_cost_choice, stable_hash
from router.types import CycleState, ReplicaView, RouteRequest, StateKey

__all__ = ["PREFIX_CHOICE", "PREFIX_TYPE", "SESSION_CHOICE", "SESSION_TYPE", "PrefixRing", "SessionRing"]

PREFIX_TYPE = "prefix-ring"
SESSION_TYPE = "session-ring"
PREFIX_CHOICE: StateKey[BoundedChoice] = StateKey(PREFIX_TYPE)
SESSION_CHOICE: StateKey[BoundedChoice] = StateKey(SESSION_TYPE)


_PLACES_PER_KEY = 4  # replicas remembered per key (where earlier turns of it were cached)


class Params(PluginParams):
    virtual_nodes: int = Field(default=200, ge=1, le=10_000)
    balance_factor: float = Field(default=1.25, ge=1.0, le=100.0)
    follow_memory: int = Field(default=100_000, ge=0, le=10_000_000)
    follow_ttl_s: float = Field(default=900.0, gt=0)


class _Ring:
    KIND: ClassVar[PluginKind] = "producer"
    READS_BLOCKS: ClassVar[bool] = False
    TYPE: ClassVar[str]
    _KEY: ClassVar[StateKey[BoundedChoice]]
    _NOTE: ClassVar[str]

    def __init__(self, name: str, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()
        self._ring = HashRing((), self.params.virtual_nodes)
        self._ring_names: tuple[str, ...] = ()
        # key -> (replica, when): where the key's prefix was last sent, so that a key that had
        # to leave its ring position (home over the bound or full) is followed by its next turn.
        self._memory: OrderedDict[int, dict[str, tuple[int, float]]] = OrderedDict()

    def _key(self, request: RouteRequest) -> int | None:
        raise NotImplementedError

    def _ring_for(self, replicas: Sequence[ReplicaView]) -> HashRing:
        names = tuple(r.name for r in replicas)
        if names != self._ring_names:
            # The ring covers the whole pool, not just today's candidates, so a replica filtered
            # out for a moment does not move every other key.
            self._ring = HashRing(names, self.params.virtual_nodes)
            self._ring_names = names
        return self._ring

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        key = self._key(request)
        if key is None or not candidates:
            return
        ring = self._ring_for(replicas)
        seen = {
            name: (sent, when)
            for name, (sent, when) in self._memory.get(key, {}).items()
            if state.now - when <= self.params.follow_ttl_s
        }
        prefer = max(seen, key=lambda n: seen[n][1]) if seen else None  # the latest turn's replica
        tokens = request.prompt_tokens
        if tokens > 0:
            # Work in prefill tokens: those queued on the replica plus this prompt's tokens not
            # cached there (what the key sent to a replica is assumed still cached there).
            costs = {
                c.name: c.prefill_tokens + tokens - min(tokens, seen.get(c.name, (0, 0.0))[0])
                for c in candidates
            }
            choice = bounded_cost_choice(ring, key, costs, self.params.balance_factor, prefer)
        else:
            loads = {c.name: c.load for c in candidates}
            choice = bounded_choice(ring, key, loads, self.params.balance_factor)
            if choice is not None and prefer is not None and prefer != choice.target and prefer in loads:
                bound = math.ceil(self.params.balance_factor * (sum(loads.values()) + 1) / len(loads))
                if loads[prefer] + 1 <= bound:
                    choice = BoundedChoice(prefer, choice.home, 0)
        if choice is not None:
            state.put(self._KEY, choice)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        choice = state.get(self._KEY)
        if choice is None:
            state.notes[self._NOTE] = "none"
            return
        key = self._key(request)
        if picked.name == choice.home:
            state.notes[self._NOTE] = "hit"
        elif picked.name == choice.target:
            state.notes[self._NOTE] = "walked" if choice.walks else "followed"
            state.notes["ring_walks"] = state.notes.get("ring_walks", 0) + choice.walks
        else:
            state.notes[self._NOTE] = "miss"
        if key is not None and self.params.follow_memory:
            places = self._memory.pop(key, {})
            places[picked.name] = (
                max(request.prompt_tokens, places.get(picked.name, (0, 0.0))[0]),
                state.now,
            )
            if len(places) > _PLACES_PER_KEY:
                del places[min(places, key=lambda n: places[n][1])]
            self._memory[key] = places
            if len(self._memory) > self.params.follow_memory:
                self._memory.popitem(last=False)


class PrefixRing(_Ring):
    TYPE: ClassVar[str] = PREFIX_TYPE
    _KEY = PREFIX_CHOICE
    _NOTE = "prefix"

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> PrefixRing:
        return cls(name, parse_params(Params, PREFIX_TYPE, name, params))

    def _key(self, request: RouteRequest) -> int | None:
        return request.prefix_key


class SessionRing(_Ring):
    TYPE: ClassVar[str] = SESSION_TYPE
    _KEY = SESSION_CHOICE
    _NOTE = "session"

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> SessionRing:
        return cls(name, parse_params(Params, SESSION_TYPE, name, params))

    def _key(self, request: RouteRequest) -> int | None:
        return stable_hash(request.session_key.encode()) if request.session_key else None
