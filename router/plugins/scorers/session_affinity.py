"""``session-affinity-scorer``: 1 for the replica the session key (``X-Session-Id``, else the
request's ``user``) hashes to on the bounded-load ring (``session-ring``), 0 for the others.

A session stays on one replica (its whole history cached there) until that replica's load would
exceed 1.25 x the average; then it moves to the next replica clockwise. No parameters.

Config example::

    - type: session-affinity-scorer
    # in a profile:  - {ref: session-affinity-scorer, weight: 4}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.producers.rings import SESSION_CHOICE, SESSION_TYPE
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "SessionAffinityScorer"]

TYPE = "session-affinity-scorer"


class SessionAffinityScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    LOCAL: ClassVar[bool] = True  # the ring walked every candidate
    CONSUMES: ClassVar[tuple[str, ...]] = (SESSION_TYPE,)

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> SessionAffinityScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        choice = state.get(SESSION_CHOICE)
        return {} if choice is None else {choice.target: 1.0}
