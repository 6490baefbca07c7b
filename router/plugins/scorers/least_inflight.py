"""``least-inflight-scorer``: the anchors' least-load signal, the gateway's own in-flight count
(SGLang's and AIBrix's ``least-request``), min-max normalised: 1 for the least loaded, 0 for the
most. No parameters.

Config example::

    - type: least-inflight-scorer
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "LeastInflightScorer", "min_max_inverse"]

TYPE = "least-inflight-scorer"


def min_max_inverse(values: Mapping[str, float]) -> dict[str, float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when they are equal."""
    if not values:
        return {}
    lo, hi = min(values.values()), max(values.values())
    if hi <= lo:
        return dict.fromkeys(values, 1.0)
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


class LeastInflightScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> LeastInflightScorer:
        parse_params(PluginParams, TYPE, name, params)
        return cls(name)

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        return min_max_inverse({c.name: float(c.inflight) for c in candidates})
