"""Control loops: the batch gate, the autoscaler and its actuators, the health prober, the canary
controller.

Each is a library object with an injected clock and injected signal sources and actuators
(``Protocol``s in :mod:`scheduler.signals`, :mod:`scheduler.gate`,
:mod:`scheduler.autoscaler.actuators`); ``tidal scheduler`` runs them against the gateway's admin
API and the batch tier, and the virtual-time benchmarks run the same objects.

Example::

    from tidal.scheduler import BatchGate, GateController

    gate = BatchGate("interactive", fleet.gate, clock=SystemClock())
    await GateController([gate], source=gateway_admin, lane=lanes, clock=SystemClock()).run()
"""

from tidal.scheduler.canary import CanaryController, CanarySpec, CanaryState, EvalRunner
from tidal.scheduler.evals import EvalError, JobEvalRunner, ReplicaEvalRunner
from tidal.scheduler.gate import (
    BatchGate,
    GateController,
    GateSample,
    GateState,
    LaneAck,
    LaneController,
    Transition,
)
from tidal.scheduler.gateway import GatewayAdmin, GatewayError
from tidal.scheduler.health import CanaryGeneration, HealthEvent, HealthProber, Prober, ProbeResult
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import GroupLoad, LoadReport, LoadSource, PoolLoad, ReplicaRegistry, ReplicaView

__all__ = [
    "BatchGate",
    "CanaryController",
    "CanaryGeneration",
    "CanarySpec",
    "CanaryState",
    "EvalError",
    "EvalRunner",
    "GateController",
    "GateSample",
    "GateState",
    "GatewayAdmin",
    "GatewayError",
    "GroupLoad",
    "HealthEvent",
    "HealthProber",
    "JobEvalRunner",
    "LaneAck",
    "LaneController",
    "LoadReport",
    "LoadSource",
    "PoolLoad",
    "ProbeResult",
    "Prober",
    "ReplicaEvalRunner",
    "ReplicaRegistry",
    "ReplicaView",
    "SchedulerMetrics",
    "Transition",
]
