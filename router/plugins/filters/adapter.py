"""``adapter-filter``: for a request naming a LoRA adapter, keep replicas that hold it or can load it.

A replica can load adapters when its ``max_loras`` is above zero (the gateway evicts the least
recently used idle adapter when all slots are taken). Requests without an adapter pass untouched.
No parameters.

Config example::

    - type: adapter-filter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "AdapterFilter"]

TYPE = "adapter-filter"


class AdapterFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"
    STATIC: ClassVar[bool] = True  # reads the request and what the pool's version covers

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> AdapterFilter:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        adapter = request.adapter
        if adapter is None:
            return candidates
        return [r for r in candidates if adapter in r.loaded_adapters or r.max_loras > 0]
