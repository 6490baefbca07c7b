"""``region-filter``: keep only replicas in the request's allowed regions (data residency).

A request whose feature lists ``regions`` carries them in :attr:`RouteRequest.regions`; replicas
inherit their pool's ``region``, and one outside those regions -- or of no region -- is dropped.
Retries route again through the same filter, so they stay inside too. Requests without regions
pass untouched. Residency is not optional: a profile that does not list this filter runs one
first (:mod:`router.loader`). No parameters.

Config example::

    - type: region-filter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "RegionFilter"]

TYPE = "region-filter"


class RegionFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"
    STATIC: ClassVar[bool] = True  # reads the request and what the pool's version covers

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> RegionFilter:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        regions = request.regions
        if regions is None:
            return candidates
        return [r for r in candidates if r.region is not None and r.region in regions]
