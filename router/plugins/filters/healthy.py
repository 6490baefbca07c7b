"""``healthy-filter``: drop replicas that are unhealthy or draining.

Parameters: ``max_snapshot_age_s`` (default ``null``: off) also drops replicas whose last
successful ``/metrics`` scrape is older than this many seconds.

Config example::

    - type: healthy-filter
      parameters: {max_snapshot_age_s: 30}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "HealthyFilter"]

TYPE = "healthy-filter"


class Params(PluginParams):
    max_snapshot_age_s: float | None = Field(default=None, gt=0)


class HealthyFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()
        # Health is covered by the pool's version; a snapshot's age moves with time.
        self.STATIC = self.params.max_snapshot_age_s is None

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> HealthyFilter:
        return cls(name, parse_params(Params, TYPE, name, params))

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        max_age = self.params.max_snapshot_age_s
        return [
            r
            for r in candidates
            if r.healthy and not r.draining and (max_age is None or r.snapshot_age_s <= max_age)
        ]
