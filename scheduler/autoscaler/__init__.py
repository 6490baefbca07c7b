"""The autoscaler: desired replicas per pool from predictive load, a warm buffer and reactive
signals; fast up, slow down (only in troughs); actuators behind one interface.

Example::

    from tidal.scheduler.autoscaler import Autoscaler, Forecaster, GaugeActuator, HourOfWeekProfile, make_policy

    scaler = Autoscaler("interactive", pool.autoscale, make_policy("tidal"), capacity=capacity,
                        actuator=GaugeActuator(), forecaster=Forecaster(HourOfWeekProfile()), clock=clock)

The local-process and Kubernetes actuators live in ``scheduler.autoscaler.local`` and
``scheduler.autoscaler.k8s`` (the latter needs the ``k8s`` extra).
"""

from tidal.scheduler.autoscaler.actuators import Actuator, GaugeActuator, PoolReplicas
from tidal.scheduler.autoscaler.capacity import (
    CapacityPlan,
    LearnsCapacity,
    OnlineCapacity,
    ReplicaCapacity,
    StaticCapacity,
    known_plan,
    plan_capacity,
    pool_slo,
)
from tidal.scheduler.autoscaler.forecast import (
    EventCalendar,
    Forecaster,
    HourOfWeekProfile,
    ScheduledEvent,
    hour_of_week,
)
from tidal.scheduler.autoscaler.policy import (
    POLICIES,
    ReactivePolicy,
    ScaleDecision,
    ScaleInput,
    ScalePolicy,
    TidalPolicy,
    make_policy,
)
from tidal.scheduler.autoscaler.scaler import Autoscaler, AutoscalerLoop, ScaleStep

__all__ = [
    "POLICIES",
    "Actuator",
    "Autoscaler",
    "AutoscalerLoop",
    "CapacityPlan",
    "EventCalendar",
    "Forecaster",
    "GaugeActuator",
    "HourOfWeekProfile",
    "LearnsCapacity",
    "OnlineCapacity",
    "PoolReplicas",
    "ReactivePolicy",
    "ReplicaCapacity",
    "ScaleDecision",
    "ScaleInput",
    "ScalePolicy",
    "ScaleStep",
    "ScheduledEvent",
    "StaticCapacity",
    "TidalPolicy",
    "hour_of_week",
    "known_plan",
    "make_policy",
    "plan_capacity",
    "pool_slo",
]
