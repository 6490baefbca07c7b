"""``load-scorer``: Tidal's load signal, the gateway's in-flight count blended with the scraped
queue and KV-cache usage.

``score = 1 - (wi * min(1, load / cap) + ww * min(1, waiting / cap) + wk * kv_usage) / (wi + ww + wk)``

where ``load`` is the in-flight count (or the scraped running + waiting when higher: other
gateways' traffic), ``waiting`` and ``kv_usage`` come from the last scrape (ignored when older
than ``max_snapshot_age_s``). Parameters: ``inflight_weight`` (1), ``waiting_weight`` (1),
``kv_weight`` (1), ``max_snapshot_age_s`` (10).

Config example::

    - type: load-scorer
      parameters: {kv_weight: 2}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest

__all__ = ["TYPE", "LoadScorer"]

TYPE = "load-scorer"


class Params(PluginParams):
    inflight_weight: float = Field(default=1.0, ge=0)
    waiting_weight: float = Field(default=1.0, ge=0)
    kv_weight: float = Field(default=1.0, ge=0)
    max_snapshot_age_s: float = Field(default=10.0, gt=0)


class LoadScorer:
    TYPE: ClassVar[str] = TYPE
    KIND: ClassVar[PluginKind] = "scorer"
    LOCAL: ClassVar[bool] = True  # a replica from its own view
    CONSUMES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str = TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> LoadScorer:
        return cls(name, parse_params(Params, TYPE, name, params))

    def score(
        self, request: RouteRequest, candidates: Sequence[ReplicaView], state: CycleState
    ) -> dict[str, float]:
        p = self.params
        total_w = p.inflight_weight + p.waiting_weight + p.kv_weight or 1.0
        out: dict[str, float] = {}
        wi, ww, wk, max_age = p.inflight_weight, p.waiting_weight, p.kv_weight, p.max_snapshot_age_s
        for c in candidates:
            cap = c.cap if c.cap > 1 else 1
            load = c.load / cap
            pressure = wi * (load if load < 1.0 else 1.0)
            snap = c.snapshot
            if snap is not None and c.snapshot_age_s <= max_age:
                waiting = snap.num_waiting / cap
                usage = snap.kv_cache_usage
                pressure += ww * (waiting if waiting < 1.0 else 1.0)
                pressure += wk * ((usage if usage < 1.0 else 1.0) if usage > 0.0 else 0.0)
            out[c.name] = 1.0 - pressure / total_w
        return out
