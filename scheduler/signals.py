"""What the scheduler reads and the surfaces it acts on, as typed values and ``Protocol``s.

The control loops never talk HTTP themselves: they read a :class:`LoadReport` from a
:class:`LoadSource` and change routing through a :class:`ReplicaRegistry`. The live scheduler
plugs in the gateway's admin API (:mod:`scheduler.gateway`); tests and the virtual-time
benchmarks plug in their own.

Example::

    report = LoadReport.from_json(await resp.json())
    report.pools["interactive"].queue_wait_p95_s
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

__all__ = [
    "GroupLoad",
    "LoadReport",
    "LoadSource",
    "PoolLoad",
    "ReplicaRegistry",
    "ReplicaView",
    "SignalError",
]


class SignalError(ValueError):
    """A signal source answered something that is not a load report."""


def _num(value: Any, where: str, *, default: float = 0.0) -> float:
    # ``null`` means "no data in the window" (no requests, no scrape yet): that is 0 for a wait,
    # a rate or a usage; a non-number is a broken source and must not silently look calm.
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SignalError(f"{where}: expected a number, got {type(value).__name__}")
    f = float(value)
    if math.isnan(f):
        return default
    if math.isinf(f) or f < 0:
        raise SignalError(f"{where}: expected a finite non-negative number, got {value!r}")
    return f


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One pool's interactive load as the gateway sees it (``/admin/load`` ``pools.<name>``)."""

    queue_depth: float = 0.0
    queue_wait_p95_s: float = 0.0
    ttft_p95_s: float = 0.0
    tpot_p95_s: float = 0.0
    inflight: float = 0.0
    kv_cache_usage_max: float = 0.0
    kv_cache_usage_mean: float = 0.0
    num_waiting: float = 0.0
    replicas_healthy: float = 0.0
    replicas_serving: float = 0.0  # healthy, not draining and weighted above 0: taking traffic
    replicas_total: float = 0.0
    requests_per_s: float = 0.0
    error_rate: float = 0.0

    @classmethod
    def from_json(cls, data: Any, where: str = "pool") -> PoolLoad:
        if not isinstance(data, Mapping):
            raise SignalError(f"{where}: expected an object")
        # Unknown keys are ignored so the gateway may add signals without breaking the scheduler.
        return cls(**{f.name: _num(data.get(f.name), f"{where}.{f.name}") for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """Request and error counts of one canary group (``/admin/load`` ``groups.<name>``)."""

    requests: float = 0.0
    errors: float = 0.0
    error_rate: float = 0.0

    @classmethod
    def from_json(cls, data: Any, where: str = "group") -> GroupLoad:
        if not isinstance(data, Mapping):
            raise SignalError(f"{where}: expected an object")
        return cls(**{f.name: _num(data.get(f.name), f"{where}.{f.name}") for f in fields(cls)})


_MAX_NAMES = 4096  # a report naming more pools or groups than this is not one we trust


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The gateway's ``GET /admin/load`` answer: wall time, per-pool load, per-group counts."""

    time: float
    pools: Mapping[str, PoolLoad] = field(default_factory=dict)
    groups: Mapping[str, GroupLoad] = field(default_factory=dict)
    # "fleet": the pools' counts and rates are every gateway's that shares load state with this
    # one; "gateway": its own alone (see merge_reports).
    scope: str = "gateway"
    # The same for the groups' request and error counts (fleet-wide counters once synced).
    groups_scope: str = "gateway"

    @classmethod
    def from_json(cls, data: Any) -> LoadReport:
        """Validate a decoded ``/admin/load`` body; raise :class:`SignalError` if it is not one."""
        if not isinstance(data, Mapping):
            raise SignalError("load report: expected an object")
        pools_raw = data.get("pools")
        groups_raw = data.get("groups")
        pools_raw = {} if pools_raw is None else pools_raw
        groups_raw = {} if groups_raw is None else groups_raw
        if not isinstance(pools_raw, Mapping) or not isinstance(groups_raw, Mapping):
            raise SignalError("load report: 'pools' and 'groups' must be objects")
        if len(pools_raw) > _MAX_NAMES or len(groups_raw) > _MAX_NAMES:
            raise SignalError("load report: too many pools or groups")
        return cls(
            scope="fleet" if data.get("scope") == "fleet" else "gateway",
            groups_scope="fleet" if data.get("groups_scope") == "fleet" else "gateway",
            time=_num(data.get("time"), "time"),
            pools={str(k): PoolLoad.from_json(v, f"pools.{k}") for k, v in pools_raw.items()},
            groups={str(k): GroupLoad.from_json(v, f"groups.{k}") for k, v in groups_raw.items()},
        )


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One registered replica as the gateway lists it (``GET /admin/replicas``)."""

    name: str
    url: str
    pool: str
    group: str = "stable"
    weight: float = 1.0
    healthy: bool = True
    draining: bool = False
    inflight: float = 0.0

    @classmethod
    def from_json(cls, data: Any) -> ReplicaView:
        if not isinstance(data, Mapping):
            raise SignalError("replica: expected an object")
        try:
            name, url, pool = str(data["name"]), str(data["url"]), str(data["pool"])
        except KeyError as exc:
            raise SignalError(f"replica: missing {exc.args[0]!r}") from None
        return cls(
            name=name,
            url=url,
            pool=pool,
            group=str(data.get("group") or "stable"),
            weight=_num(data.get("weight"), f"replicas.{name}.weight", default=1.0),
            healthy=bool(data.get("healthy", True)),
            draining=bool(data.get("draining", False)),
            inflight=_num(data.get("inflight"), f"replicas.{name}.inflight"),
        )


class LoadSource(Protocol):
    """Where the gate and the autoscaler read load from (the gateway's ``/admin/load``)."""

    async def load(self) -> LoadReport: ...


class ReplicaRegistry(Protocol):
    """The router's replica registry: what the health prober, canary and actuators change."""

    async def replicas(self) -> list[ReplicaView]: ...

    async def register(
        self,
        name: str,
        url: str,
        pool: str,
        *,
        group: str = "stable",
        weight: float = 1.0,
        max_loras: int = 0,
        kv_events: Mapping[str, str | None] | None = None,
    ) -> None: ...

    async def update(
        self,
        name: str,
        *,
        healthy: bool | None = None,
        weight: float | None = None,
        draining: bool | None = None,
    ) -> None: ...

    async def deregister(self, name: str) -> None: ...
