"""The one interface every way of changing a pool's size implements.

* :class:`GaugeActuator` -- changes nothing itself; the ``tidal_autoscaler_desired_replicas``
  gauge (always exported) is read by KEDA or an HPA (``deploy/keda/scaledobject.yaml``).
* :class:`~scheduler.autoscaler.local.LocalProcessActuator` -- starts and stops ``tidal sim`` or
  real vLLM processes on this machine and registers them with the gateway.
* :class:`~scheduler.autoscaler.k8s.KubernetesActuator` -- sets a Deployment's ``scale``.

Example::

    actuator: Actuator = GaugeActuator()
    await actuator.scale("interactive", 6)
    seen = await actuator.observe("interactive", load)     # PoolReplicas(ready=4, starting=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tidal.scheduler.signals import PoolLoad

__all__ = ["Actuator", "GaugeActuator", "PoolReplicas"]


@dataclass(frozen=True, slots=True)
class PoolReplicas:
    """Replicas of a pool that serve (``ready``) and that were asked for but are cold-starting."""

    ready: int
    starting: int = 0

    @property
    def total(self) -> int:
        return self.ready + self.starting


class Actuator(Protocol):
    """Sets the number of replicas of a pool and replaces broken ones."""

    name: str

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        """How many replicas serve and how many are starting (``load`` is the gateway's view)."""
        ...

    async def scale(self, pool: str, replicas: int) -> None:
        """Ask for ``replicas`` in total; idempotent, returns once the request is placed."""
        ...

    async def replace(self, pool: str, replica: str) -> bool:
        """Drain and replace one replica; ``False`` if this actuator does not manage it."""
        ...


class GaugeActuator:
    """For KEDA/HPA: the desired-replicas gauge is the actuation; the gateway says what is ready."""

    name = "gauge"

    def __init__(self) -> None:
        self._desired: dict[str, int] = {}

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        # Ready means taking traffic: a canary held at weight 0 adds no capacity.
        ready = int(load.replicas_serving) if load is not None else 0
        total = int(load.replicas_total) if load is not None else 0
        # Replicas the external scaler is still bringing up are not registered yet.
        return PoolReplicas(ready=ready, starting=max(0, self._desired.get(pool, total) - total))

    async def scale(self, pool: str, replicas: int) -> None:
        self._desired[pool] = replicas

    async def replace(self, pool: str, replica: str) -> bool:
        return False
