"""Priority classes, batch priorities and lanes: the one place the priority directions are written.

Two systems, two opposite conventions:

* **vLLM** ``priority`` (request field, ``--scheduling-policy priority``): a **smaller** value is
  scheduled **sooner**, and under memory pressure the request with the *largest* value is
  preempted first. Interactive classes use small values (0), batch uses large ones (100+).
* **RabbitMQ** message priority (queues declared with ``x-max-priority``): a **larger** number is
  delivered **first**.

A batch carries a user-facing priority ``0..9`` where, as in RabbitMQ, **9 is the most urgent**.
:func:`rabbitmq_priority` passes it through unchanged; :func:`vllm_priority` maps it into vLLM's
direction *below* every interactive class (``batch_base + 9 - p``), so batch requests never overtake
interactive ones inside a replica, and urgent batches go before relaxed ones.

Example::

    rabbitmq_priority(9) == 9          # delivered before priority 0 messages
    vllm_priority(9) < vllm_priority(0)   # scheduled sooner inside the replica
"""

from __future__ import annotations

from enum import StrEnum

from tidal.fleet import FleetConfig, PoolSpec

__all__ = [
    "BATCH_PRIORITY_MAX",
    "BATCH_VLLM_BASE",
    "Lane",
    "lane_pools",
    "rabbitmq_priority",
    "vllm_priority",
]

BATCH_PRIORITY_MAX = 9  # queues are declared with x-max-priority = 10 levels (0..9)
BATCH_VLLM_BASE = 100  # vLLM priority of the most urgent batch line; interactive classes stay below


class Lane(StrEnum):
    """Where batch work runs.

    * ``reserved`` -- the dedicated batch pool (large ``max_num_seqs``);
    * ``spot`` -- preemptible capacity; workers save progress on SIGTERM;
    * ``shared`` -- interactive replicas borrowed while the scheduler's gate is open.
    """

    RESERVED = "reserved"
    SPOT = "spot"
    SHARED = "shared"


def lane_pools(fleet: FleetConfig, lane: str) -> list[PoolSpec]:
    """The pools whose replicas a lane's workers send to: ``reserved`` the ``batch`` pools,
    ``spot`` the ``spot`` pools, ``shared`` the interactive pools with ``shared: true``."""
    if lane == Lane.RESERVED:
        return fleet.pools_of_kind("batch")
    if lane == Lane.SPOT:
        return fleet.pools_of_kind("spot")
    if lane == Lane.SHARED:
        return [p for p in fleet.pools_of_kind("interactive") if p.shared]
    raise ValueError(f"unknown lane {lane!r}")


def _check(p: int) -> int:
    if not 0 <= p <= BATCH_PRIORITY_MAX:
        raise ValueError(f"batch priority must be between 0 and {BATCH_PRIORITY_MAX}, got {p}")
    return p


def rabbitmq_priority(batch_priority: int) -> int:
    """RabbitMQ message priority of a batch's chunks (larger is delivered first)."""
    return _check(batch_priority)


def vllm_priority(batch_priority: int, base: int = BATCH_VLLM_BASE) -> int:
    """vLLM request priority of a batch line (smaller is scheduled sooner)."""
    return base + BATCH_PRIORITY_MAX - _check(batch_priority)
