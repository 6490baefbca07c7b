"""The scheduler's Prometheus metrics, one object per process (or per test).

Names follow ``tidal_<subsystem>_<what>_<unit>``. Each control loop takes a
:class:`SchedulerMetrics`; without one it makes a private registry, so tests and benchmarks never
collide on the global one.

Example::

    metrics = SchedulerMetrics()          # its own CollectorRegistry
    prometheus_client.start_http_server(9100, registry=metrics.registry)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["SchedulerMetrics"]

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SchedulerMetrics:
    """Every metric the gate, autoscaler, health prober and canary controller export."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        # -- batch gate --
        self.gate_paused = Gauge(
            "tidal_gate_paused", "1 while the pool's batch gate is paused", ["pool"], registry=r
        )
        self.gate_transitions = Counter(
            "tidal_gate_transitions_total",
            "Gate transitions by target state and reason",
            ["pool", "to", "reason"],
            registry=r,
        )
        self.gate_actuation_seconds = Histogram(
            "tidal_gate_actuation_seconds",
            "Time from a gate transition to the lane's acknowledgement",
            ["pool", "action"],
            buckets=_FAST,
            registry=r,
        )
        self.gate_actuation_failures = Counter(
            "tidal_gate_actuation_failures_total",
            "Pause/resume calls that failed or were not confirmed",
            ["pool", "action"],
            registry=r,
        )
        self.gate_decision_seconds = Histogram(
            "tidal_gate_decision_seconds",
            "Time to sample and decide, per loop iteration",
            buckets=_FAST,
            registry=r,
        )
        self.gate_queue_wait = Gauge(
            "tidal_gate_queue_wait_p95_seconds",
            "Interactive queue wait p95 the gate last saw",
            ["pool"],
            registry=r,
        )
        self.gate_kv_usage = Gauge(
            "tidal_gate_kv_cache_usage_ratio",
            "Largest replica KV-cache usage the gate last saw",
            ["pool"],
            registry=r,
        )
        self.gate_signal_errors = Counter(
            "tidal_gate_signal_errors_total", "Load samples that could not be read", registry=r
        )
        # -- autoscaler --
        self.desired_replicas = Gauge(
            "tidal_autoscaler_desired_replicas",
            "Replicas the autoscaler wants per pool (KEDA/HPA read this)",
            ["pool"],
            registry=r,
        )
        self.ready_replicas = Gauge(
            "tidal_autoscaler_ready_replicas", "Replicas serving per pool", ["pool"], registry=r
        )
        self.starting_replicas = Gauge(
            "tidal_autoscaler_starting_replicas",
            "Replicas started but not ready yet (cold start)",
            ["pool"],
            registry=r,
        )
        self.predicted_rps = Gauge(
            "tidal_autoscaler_predicted_requests_per_second",
            "Forecast peak request rate over the cold-start horizon",
            ["pool"],
            registry=r,
        )
        self.capacity_rps = Gauge(
            "tidal_autoscaler_replica_capacity_requests_per_second",
            "Requests/s one replica serves within the SLO, as the autoscaler sizes the pool now",
            ["pool"],
            registry=r,
        )
        self.planned_capacity_rps = Gauge(
            "tidal_autoscaler_planned_capacity_requests_per_second",
            "One replica's capacity from the config or the plan, before online learning",
            ["pool"],
            registry=r,
        )
        self.trough_spare = Gauge(
            "tidal_autoscaler_trough_spare_replicas",
            "Replicas offered to batch while the pool is in a trough",
            ["pool"],
            registry=r,
        )
        self.scale_decisions = Counter(
            "tidal_autoscaler_decisions_total",
            "Scale decisions by direction",
            ["pool", "policy", "direction"],
            registry=r,
        )
        self.scale_decision_seconds = Histogram(
            "tidal_autoscaler_decision_seconds",
            "Time the policy took to decide",
            ["policy"],
            buckets=_FAST,
            registry=r,
        )
        self.actuator_errors = Counter(
            "tidal_autoscaler_actuator_errors_total",
            "Actuator calls that failed",
            ["pool", "actuator"],
            registry=r,
        )
        # -- health --
        self.probes = Counter(
            "tidal_health_probes_total", "Canary generations by result", ["replica", "result"], registry=r
        )
        self.probe_seconds = Histogram(
            "tidal_health_probe_seconds", "Canary generation latency", buckets=_FAST, registry=r
        )
        self.health_transitions = Counter(
            "tidal_health_transitions_total",
            "Replicas taken out of or put back into routing",
            ["replica", "to"],
            registry=r,
        )
        self.replacements = Counter(
            "tidal_health_replacements_total", "Unhealthy replicas drained and replaced", ["pool"], registry=r
        )
        # -- canary --
        self.canary_share = Gauge(
            "tidal_canary_share_ratio", "Traffic share given to the canary group", ["group"], registry=r
        )
        self.canary_outcomes = Counter(
            "tidal_canary_outcomes_total",
            "Finished rollouts by outcome and reason",
            ["group", "outcome", "reason"],
            registry=r,
        )
