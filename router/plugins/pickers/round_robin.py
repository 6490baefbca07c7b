"""``round-robin-picker``: the candidates in turn, whatever the scores (the K8s Service baseline).
No parameters.

Config example::

    - type: round-robin-picker
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView

__all__ = ["TYPE", "RoundRobinPicker"]

TYPE = "round-robin-picker"


class RoundRobinPicker:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "picker"

    def __init__(self, name: str = TYPE) -> None:
        self.name = name
        self._next = 0

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> RoundRobinPicker:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def pick(self, scored: Sequence[tuple[ReplicaView, float]], state: CycleState) -> ReplicaView:
        replica = scored[self._next % len(scored)][0]
        self._next += 1
        return replica
