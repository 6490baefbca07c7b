"""``power-of-two-picker``: draw two candidates at random (seeded RNG) and take the higher scored
(with ``least-inflight-scorer``: the less loaded of two; Mitzenmacher's power of two choices).
No parameters.

Config example::

    - type: power-of-two-picker
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView

__all__ = ["TYPE", "PowerOfTwoPicker"]

TYPE = "power-of-two-picker"


class PowerOfTwoPicker:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "picker"

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> PowerOfTwoPicker:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def pick(self, scored: Sequence[tuple[ReplicaView, float]], state: CycleState) -> ReplicaView:
        if len(scored) == 1:
            return scored[0][0]
        i, j = state.rng.sample(range(len(scored)), 2)
        a, b = scored[i], scored[j]
        return a[0] if a[1] >= b[1] else b[0]
