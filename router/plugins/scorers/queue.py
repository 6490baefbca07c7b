"""``queue-scorer``: llm-d's queue scorer, the scraped ``vllm:num_requests_waiting`` min-max
normalised (1 for the shortest queue). Replicas without a snapshot count as empty. No parameters.

Config example::

    - type: queue-scorer
    # llm-d's default profile:  queue 2, kv-cache-utilization 2, prefix-cache 3
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.plugins.scorers.least_inflight import min_max_inverse
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "QueueScorer"]

TYPE = "queue-scorer"


class QueueScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> QueueScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        return min_max_inverse(
            {c.name: c.snapshot.num_waiting if c.snapshot is not None else 0.0 for c in candidates}
        )
