"""How much load one replica of a pool carries within the latency targets.

The autoscaler turns request rates into replica counts through a :class:`ReplicaCapacity`.
:class:`StaticCapacity` reads ``capacity_rps_per_replica`` from the fleet config; a capacity
measured on the simulated replica's cost model (``replicas.sim``) plugs in behind the same
interface.

Example::

    capacity = StaticCapacity.from_fleet(fleet)
    capacity.capacity_rps("interactive")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from tidal.fleet import FleetConfig

__all__ = ["ReplicaCapacity", "StaticCapacity"]


class ReplicaCapacity(Protocol):
    """Requests per second one replica of ``pool`` serves while meeting the TTFT/TPOT targets."""

    def capacity_rps(self, pool: str) -> float: ...


class StaticCapacity:
    """Capacities given up front (the fleet config's ``capacity_rps_per_replica``)."""

    def __init__(self, per_pool: Mapping[str, float], default: float | None = None) -> None:
        for pool, c in per_pool.items():
            if not c > 0:
                raise ValueError(f"capacity of pool {pool} must be positive")
        self._per_pool = dict(per_pool)
        self._default = default

    @classmethod
    def from_fleet(cls, fleet: FleetConfig) -> StaticCapacity:
        return cls({n: p.autoscale.capacity_rps_per_replica for n, p in fleet.pools.items() if p.autoscale})

    def capacity_rps(self, pool: str) -> float:
        c = self._per_pool.get(pool, self._default)
        if c is None:
            raise KeyError(f"no replica capacity known for pool {pool}")
        return c
