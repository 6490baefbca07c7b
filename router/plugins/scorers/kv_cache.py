"""``kv-cache-utilization-scorer``: llm-d's KV scorer, ``1 - vllm:kv_cache_usage_perc`` from the
last scrape (1 when unknown). No parameters.

Config example::

    - type: kv-cache-utilization-scorer
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "KVCacheUtilizationScorer"]

TYPE = "kv-cache-utilization-scorer"


class KVCacheUtilizationScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> KVCacheUtilizationScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        return {c.name: 1.0 - (c.snapshot.kv_cache_usage if c.snapshot else 0.0) for c in candidates}
