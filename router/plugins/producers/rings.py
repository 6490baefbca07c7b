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

import functools
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.pool import CANDIDATES, Candidates, ViewCandidates
from tidal.router.ring import BoundedChoice, HashRing, load_bound, stable_hash, walk_to_fit
from tidal.router.types import CycleState, ReplicaView, RouteRequest, StateKey

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
        self._ring_key: Hashable = ()
        # key -> ((replica, tokens sent, when), ...): where the key's prefix was last sent, so that
        # a key that had to leave its ring position (home over the bound or full) is followed by
        # its next turn.
        self._memory: OrderedDict[int, tuple[tuple[str, int, float], ...]] = OrderedDict()

    def _key(self, request: RouteRequest) -> int | None:
        raise NotImplementedError

    def _ring_for(self, candidates: Candidates) -> HashRing:
        if candidates.ring_key != self._ring_key:
            # The ring covers the whole pool, not just today's candidates, so a replica filtered
            # out for a moment does not move every other key.
            self._ring = HashRing(candidates.pool_names(), self.params.virtual_nodes)
            self._ring_key = candidates.ring_key
        return self._ring

    def nominate(self, request: RouteRequest, candidates: Candidates, state: CycleState) -> tuple[str, ...]:
        choice = self._choose(request, candidates, state)
        return () if choice is None else (choice.target, choice.home)

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        if state.get(self._KEY) is None and candidates:
            pool = state.get(CANDIDATES)
            if pool is None:
                pool = ViewCandidates(candidates, replicas)
                state.put(CANDIDATES, pool)
            self._choose(request, pool, state)

    def _choose(
        self, request: RouteRequest, candidates: Candidates, state: CycleState
    ) -> BoundedChoice | None:
        """Walk the ring from the request's key over ``candidates`` (every replica that passed the
        filters, which the walk visits only as far as it goes) and put the choice in the state."""
        key = self._key(request)
        n = len(candidates)
        if key is None or not n:
            return None
        ring = self._ring_for(candidates)
        places = self._memory.get(key)
        seen = (
            {
                name: (sent, when)
                for name, sent, when in places
                if state.now - when <= self.params.follow_ttl_s
            }
            if places
            else {}
        )
        prefer = max(seen, key=lambda n: seen[n][1]) if seen else None  # the latest turn's replica
        tokens = request.prompt_tokens
        view = candidates.view
        choice: BoundedChoice | None
        if tokens > 0:
            # Work in prefill tokens: those queued on the replica plus this prompt's tokens not
            # cached there (what the key sent to a replica is assumed still cached there).
            def cost(name: str) -> float:
                v = view(name)
                assert v is not None
                return v.prefill_tokens + tokens - (min(tokens, seen[name][0]) if name in seen else 0)

            total = candidates.total_prefill() + n * tokens
            if seen:
                total -= sum(min(tokens, sent) for name, (sent, _) in seen.items() if name in candidates)
            bound = self.params.balance_factor * total / n
            target, home, walks = walk_to_fit(
                ring, key, candidates.__contains__, lambda name: cost(name) <= bound, prefer
            )
            if target is None:  # not reached: the cheapest candidate is within the mean
                target = min(self._every(candidates), key=cost)
            choice = BoundedChoice(target, home or target, walks)
        else:
            bound_n = load_bound(candidates.total_load(), n, self.params.balance_factor)

            def fits(name: str) -> bool:
                v = view(name)
                return v is not None and v.load + 1 <= bound_n

            target, home, walks = walk_to_fit(ring, key, candidates.__contains__, fits)
            if target is None:
                target = min(self._every(candidates), key=lambda name: view(name).load)  # type: ignore[union-attr]
            choice = BoundedChoice(target, home or target, walks)
            if prefer is not None and prefer != choice.target and fits(prefer):
                choice = BoundedChoice(prefer, choice.home, 0)
        state.put(self._KEY, choice)
        return choice

    @staticmethod
    def _every(candidates: Candidates) -> list[str]:
        return [n for n in candidates.pool_names() if n in candidates]

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
            places = {name: (sent, when) for name, sent, when in self._memory.pop(key, ())}
            places[picked.name] = (
                max(request.prompt_tokens, places.get(picked.name, (0, 0.0))[0]),
                state.now,
            )
            if len(places) > _PLACES_PER_KEY:
                del places[min(places, key=lambda n: places[n][1])]
            # Tuples of strings and numbers, which the collector stops tracking: a full memory
            # costs a full collection one visit per key, not five objects.
            self._memory[key] = tuple((name, sent, when) for name, (sent, when) in places.items())
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
        return _session_hash(request.session_key) if request.session_key else None


@functools.lru_cache(maxsize=4096)
def _session_hash(session: str) -> int:
    """A session's ring key (asked twice per decision: before and after the pick)."""
    return stable_hash(session.encode())
