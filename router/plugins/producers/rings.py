"""``prefix-ring`` and ``session-ring``: bounded-load consistent hashing of a request key.

Both place the pool's replicas on a hash ring (``virtual_nodes`` points each) and walk it from
the request key's position to the first candidate whose load (the gateway's in-flight count, or
the scraped running + waiting when higher), counting this request, stays within
``ceil(balance_factor * (total + 1) / n)``. The result (target, home, walks) goes into the cycle
state for :mod:`~router.plugins.scorers.prefix_affinity` and
:mod:`~router.plugins.scorers.session_affinity`; after the pick the notes say whether the
request stayed home (``hit``), walked, or went elsewhere (``miss``).

* ``prefix-ring`` hashes the stable prompt prefix (:mod:`router.prefix`);
* ``session-ring`` hashes ``X-Session-Id`` or the request's ``user``.

Parameters: ``virtual_nodes`` (default 200), ``balance_factor`` (default 1.25, the c in c x average).

Config example::

    - type: prefix-ring
      parameters: {virtual_nodes: 200, balance_factor: 1.25}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from router.framework import PluginKind
from router.plugins.base import PluginParams, parse_params
from router.ring import BoundedChoice, HashRing, bounded_choice, stable_hash
from router.types import CycleState, ReplicaView, RouteRequest, StateKey

__all__ = ["PREFIX_CHOICE", "PREFIX_TYPE", "SESSION_CHOICE", "SESSION_TYPE", "PrefixRing", "SessionRing"]

PREFIX_TYPE = "prefix-ring"
SESSION_TYPE = "session-ring"
PREFIX_CHOICE: StateKey[BoundedChoice] = StateKey(PREFIX_TYPE)
SESSION_CHOICE: StateKey[BoundedChoice] = StateKey(SESSION_TYPE)


class Params(PluginParams):
    virtual_nodes: int = Field(default=200, ge=1, le=10_000)
    balance_factor: float = Field(default=1.25, ge=1.0, le=100.0)


class _Ring:
    KIND: ClassVar[PluginKind] = "producer"
    TYPE: ClassVar[str]
    _KEY: ClassVar[StateKey[BoundedChoice]]
    _NOTE: ClassVar[str]

    def __init__(self, name: str, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()
        self._ring = HashRing((), self.params.virtual_nodes)
        self._ring_names: tuple[str, ...] = ()

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
        if key is None:
            return
        loads = {c.name: c.load for c in candidates}
        choice = bounded_choice(self._ring_for(replicas), key, loads, self.params.balance_factor)
        if choice is not None:
            state.put(self._KEY, choice)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        choice = state.get(self._KEY)
        if choice is None:
            state.notes[self._NOTE] = "none"
            return
        if picked.name == choice.home:
            state.notes[self._NOTE] = "hit"
        elif picked.name == choice.target:
            state.notes[self._NOTE] = "walked"
            state.notes["ring_walks"] = state.notes.get("ring_walks", 0) + choice.walks
        else:
            state.notes[self._NOTE] = "miss"


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
