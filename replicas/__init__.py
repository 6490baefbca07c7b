"""Everything about a replica: the HTTP client, ``/metrics`` parsing, the process launcher, the
tiny-model builder for real vLLM on the CPU, and ``replicas.sim`` (the simulated replica)."""

from tidal.replicas.client import ReplicaClient, UpstreamResponse, iter_sse_events
from tidal.replicas.errors import (
    ReplicaError,
    ReplicaModelNotFound,
    ReplicaRequestError,
    ReplicaServerError,
    ReplicaStreamError,
    ReplicaTimeout,
    ReplicaUnavailable,
)
from tidal.replicas.metrics import LoadSnapshot, parse_load_snapshot
from tidal.replicas.wire.prom import Histogram

__all__ = [
    "Histogram",
    "LoadSnapshot",
    "ReplicaClient",
    "ReplicaError",
    "ReplicaModelNotFound",
    "ReplicaRequestError",
    "ReplicaServerError",
    "ReplicaStreamError",
    "ReplicaTimeout",
    "ReplicaUnavailable",
    "UpstreamResponse",
    "iter_sse_events",
    "parse_load_snapshot",
]
