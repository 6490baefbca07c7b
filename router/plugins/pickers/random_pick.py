"""``random-picker``: a uniformly random candidate (seeded RNG), whatever the scores.
No parameters.

Config example::

    - type: random-picker
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView

__all__ = ["TYPE", "RandomPicker"]

TYPE = "random-picker"


class RandomPicker:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "picker"

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> RandomPicker:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def pick(self, scored: Sequence[tuple[ReplicaView, float]], state: CycleState) -> ReplicaView:
        return scored[state.rng.randrange(len(scored))][0]
