"""``model-filter``: keep replicas that serve the request's base model.

A replica whose model is unknown (empty) is kept. No parameters.

Config example::

    - type: model-filter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "ModelFilter"]

TYPE = "model-filter"


class ModelFilter:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "filter"
    STATIC: ClassVar[bool] = True  # reads the request and what the pool's version covers

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> ModelFilter:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def filter(
        self, request: RouteRequest, candidates: list[ReplicaView], state: CycleState
    ) -> list[ReplicaView]:
        return [r for r in candidates if not r.model or r.model == request.model]
