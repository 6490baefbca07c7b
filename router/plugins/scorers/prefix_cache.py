"""``prefix-cache-scorer``: llm-d's approximate prefix scorer: the share of the request's leading
prompt blocks that the ``approx-prefix-index`` believes each replica holds. No parameters.

Config example::

    - type: prefix-cache-scorer
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.producers.block_index import INDEX_MATCH, INDEX_TYPE
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "PrefixCacheScorer"]

TYPE = "prefix-cache-scorer"


class PrefixCacheScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = (INDEX_TYPE,)

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> PrefixCacheScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        return state.get(INDEX_MATCH) or {}
