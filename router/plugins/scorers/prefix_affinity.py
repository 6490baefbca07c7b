"""``prefix-affinity-scorer``: 1 for the replica the stable prompt prefix hashes to on the
bounded-load ring (``prefix-ring``), 0 for the others; no scores when the request has no prefix key.

The stable prefix is the system prompt, the tools and the first user turn (see
:mod:`router.prefix` for why the system prompt alone is not enough); the ring keeps a key on
its replica until that replica's load would exceed 1.25 x the average, then walks clockwise.
No parameters (the ring's are on ``prefix-ring``).

Config example::

    - type: prefix-affinity-scorer
    # in a profile:  - {ref: prefix-affinity-scorer, weight: 2}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.producers.rings import PREFIX_CHOICE, PREFIX_TYPE
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "PrefixAffinityScorer"]

TYPE = "prefix-affinity-scorer"


class PrefixAffinityScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    LOCAL: ClassVar[bool] = True  # the ring walked every candidate
    CONSUMES: ClassVar[tuple[str, ...]] = (PREFIX_TYPE,)

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> PrefixAffinityScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        choice = state.get(PREFIX_CHOICE)
        return {} if choice is None else {choice.target: 1.0}
