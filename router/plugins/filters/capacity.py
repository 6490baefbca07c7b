"""``capacity-filter``: keep replicas below their in-flight cap (the capped batch).

Admission lets a request through only when its pool has a free slot, so an empty result means
two requests raced for the last slot; then every candidate is kept and the replica goes one over
its cap for a moment rather than failing the request. No parameters.

Config example::

    - type: capacity-filter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.pool import PoolCandidates
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "CapacityFilter"]

TYPE = "capacity-filter"


class CapacityFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> CapacityFilter:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        free = [r for r in candidates if r.inflight < r.cap]
        return free or candidates

    def narrow(self, request: RouteRequest, candidates: PoolCandidates, state: CycleState) -> PoolCandidates:
        cut = candidates.without_full()
        return cut if len(cut) else candidates
