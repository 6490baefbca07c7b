"""``max-score-picker``: the highest total score; ties broken by the router's seeded RNG.
No parameters.

Config example::

    - type: max-score-picker
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView

__all__ = ["TYPE", "MaxScorePicker"]

TYPE = "max-score-picker"


class MaxScorePicker:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "picker"
    LOCAL: ClassVar[bool] = True  # the best of any subset that holds the best is the best

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> MaxScorePicker:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def pick(self, scored: Sequence[tuple[ReplicaView, float]], state: CycleState) -> ReplicaView:
        best = max(s for _, s in scored)
        # A small tolerance, so that float noise in weighted sums does not decide a tie.
        tied = [r for r, s in scored if s >= best - 1e-9]
        return tied[0] if len(tied) == 1 else tied[state.rng.randrange(len(tied))]
