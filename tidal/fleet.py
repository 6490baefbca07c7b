"""The fleet config: pools, replicas, models, adapters, features, classes and thresholds.

Loading is strict: an unknown key, a bad value, a duplicate YAML key or a reference to something
that does not exist is an error whose message names the key, e.g.::

    fleet config examples/fleet.yaml is invalid:
      pools.interactive.replicas[0].url: URL scheme should be 'http' or 'https'
      features.chat.class: unknown class 'fast' (known: batch, interactive)

Example::

    fleet = load_fleet("examples/fleet.yaml")
    for pool in fleet.pools.values():
        print(pool.name, [r.url for r in pool.replicas])
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AnyHttpUrl,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    UrlConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "BATCH_ONLY_KINDS",
    "EMBEDDINGS_ENDPOINT",
    "AdapterSpec",
    "AutoscalerSpec",
    "CanaryEvalSpec",
    "CapacityPlanSpec",
    "CanaryRolloutSpec",
    "ClassSpec",
    "ExternalProviderSpec",
    "FeatureSpec",
    "FleetConfig",
    "FleetConfigError",
    "GateSpec",
    "GatewaySpec",
    "KVEventsSpec",
    "KubernetesKVEventsSpec",
    "KubernetesTargetSpec",
    "LaunchSpec",
    "ModelSpec",
    "PluginSpec",
    "PoolKind",
    "PoolSpec",
    "ProfilePluginRef",
    "ProfileSpec",
    "QuotaSpec",
    "ReplicaSpec",
    "RouterSpec",
    "ScheduledEventSpec",
    "TenantBatchSpec",
    "TenantSpec",
    "check_zmq_endpoint",
    "hash_api_key",
    "load_fleet",
    "parse_fleet",
    "verify_api_key",
]

HttpUrl = Annotated[AnyHttpUrl, UrlConstraints(allowed_schemes=["http", "https"])]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]
# A feature a tenant may use, or "*" for every feature.
FeatureRef = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9._:/-]*)$")
]
PoolKind = Literal["interactive", "batch", "spot", "long_context"]
# Pools that only the batch tier uses: interactive requests are never placed on them.
BATCH_ONLY_KINDS: frozenset[str] = frozenset({"batch", "spot"})
# The one endpoint an embedding model (``models[].embedding``) answers, and the only one it does.
EMBEDDINGS_ENDPOINT = "/v1/embeddings"


class FleetConfigError(ValueError):
    """A fleet config that cannot be used; the message lists every offending key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"fleet config {source} is invalid:\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelSpec(_Strict):
    """A base model the fleet serves.

    ``tokenizer`` lets gateways tokenise prompts as the replicas do, for the exact KV index
    (replicas that publish ``kv_events``): a model directory with ``tokenizer.json`` and its chat
    template, or ``sim`` for the simulator's built-in tokenizer (``tidal sim`` without
    ``--tokenizer``). Without it the gateway estimates what replicas cache.
    """

    name: Name
    max_model_len: int = Field(default=8192, gt=0, le=10_000_000)
    embedding: bool = False
    tokenizer: str | None = Field(default=None, min_length=1, max_length=4096)

    def serves(self, endpoint: str) -> bool:
        """Whether it can answer ``endpoint``: an embedding model ``/v1/embeddings`` alone, a
        generative one everything else."""
        return self.embedding == (endpoint == EMBEDDINGS_ENDPOINT)


class AdapterSpec(_Strict):
    """A LoRA adapter that replicas may load at run time (``/v1/load_lora_adapter``).

    ``tenants`` binds it to those tenants: to any other the adapter does not exist (absent: every
    tenant may use it).
    """

    name: Name
    path: str = Field(min_length=1)
    base_model: Name
    tenants: list[Name] | None = Field(default=None, min_length=1)

    def serves(self, tenant: str) -> bool:
        """Whether ``tenant`` may use (and see) this adapter."""
        return self.tenants is None or tenant in self.tenants


class LaunchSpec(_Strict):
    """How ``tidal up`` starts a replica locally: a simulated one or a real vLLM process.

    For a simulated one, ``answer_key`` (JSONL of ``{"prompt", "answer"}``) makes it answer those
    prompts so, right with probability ``accuracy`` (a worse build for a canary rollout). A
    relative path is read from the fleet file's folder.
    """

    kind: Literal["sim", "vllm"]
    preset: str | None = None
    model_dir: str | None = None
    args: list[str] = Field(default_factory=list)
    answer_key: str | None = Field(default=None, min_length=1, max_length=4096)
    accuracy: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_kind(self) -> LaunchSpec:
        if self.kind == "sim" and not self.preset:
            raise ValueError("a sim launch needs 'preset'")
        if self.kind == "vllm" and not self.model_dir:
            raise ValueError("a vllm launch needs 'model_dir'")
        if self.kind != "sim" and (self.answer_key is not None or self.accuracy is not None):
            raise ValueError("answer_key and accuracy are for simulated replicas")
        if self.accuracy is not None and self.answer_key is None:
            raise ValueError("accuracy needs an answer_key")
        return self

    def extra_args(self) -> list[str]:
        """What the launched process gets besides its model and port: a simulated replica's
        ``answer_key``/``accuracy`` as options, then ``args``."""
        out = ["--answer-key", self.answer_key] if self.answer_key else []
        out += ["--accuracy", f"{self.accuracy:g}"] if self.accuracy is not None else []
        return out + self.args


_TCP_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})$")


_HOST_PATTERN = re.compile(r"[A-Za-z0-9*?._-]+")


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def endpoint_host(endpoint: str) -> str | None:
    """The host of a URL or a ``tcp://HOST:PORT`` endpoint; ``None`` for ``ipc://`` (a path)."""
    if endpoint.startswith("ipc://"):
        return None
    return urlsplit(endpoint).hostname or ""


def check_zmq_endpoint(value: str) -> str:
    """A ZMQ address a gateway can connect to: ``tcp://HOST:PORT`` (no wildcard host) or
    ``ipc://PATH``."""
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    m = _TCP_ENDPOINT.match(value)
    if m is None:
        raise ValueError(f"'{value}' is not tcp://HOST:PORT or ipc://PATH (a wildcard host is for binding)")
    if not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"'{value}': port out of range")
    return value


class KVEventsSpec(_Strict):
    """Where a replica publishes its KV-cache events (vLLM ``--kv-events-config``, ``tidal sim
    --kv-events-endpoint``): the addresses gateways connect to. A ``launch`` block binds the same
    ports on every interface of its host (``tcp://*:PORT``)."""

    endpoint: str = Field(max_length=512)
    replay_endpoint: str | None = Field(default=None, max_length=512)
    topic: str = Field(default="", max_length=256)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_zmq_endpoint(v)

    @model_validator(mode="after")
    def _distinct(self) -> KVEventsSpec:
        if self.replay_endpoint == self.endpoint:
            raise ValueError("replay_endpoint must differ from endpoint")
        return self


class ReplicaSpec(_Strict):
    """One replica: anything that speaks vLLM's OpenAI-compatible API and ``/metrics``.

    ``kv_events``: where it publishes KV-cache events, for the gateways' exact KV index.
    """

    name: Name
    url: HttpUrl
    group: Name = "stable"
    weight: float = Field(default=1.0, ge=0.0, le=1000.0)
    max_loras: int = Field(default=0, ge=0, le=1024)
    launch: LaunchSpec | None = None
    kv_events: KVEventsSpec | None = None

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class ScheduledEventSpec(_Strict):
    """A known future load event (a sale, a cricket match) the autoscaler prepares for.

    During ``[start - lead_s, end)`` the forecast is the learned load times ``multiplier``, or at
    least ``expected_rps`` when given. Times need a UTC offset, e.g. ``2026-03-08T14:00:00+05:30``.
    """

    name: Name
    start: AwareDatetime
    end: AwareDatetime
    multiplier: float | None = Field(default=None, gt=0.0, le=1000.0)
    expected_rps: float | None = Field(default=None, ge=0.0, le=1e9)
    lead_s: float = Field(default=900.0, ge=0.0, le=7 * 24 * 3600.0)

    @model_validator(mode="after")
    def _check(self) -> ScheduledEventSpec:
        if self.end <= self.start:
            raise ValueError("end must be after start")
        if self.multiplier is None and self.expected_rps is None:
            raise ValueError("an event needs 'multiplier' or 'expected_rps'")
        return self


class KubernetesKVEventsSpec(_Strict):
    """The ports on which every pod of a Kubernetes-scaled pool publishes its KV-cache events (vLLM
    ``--kv-events-config`` binding ``tcp://*:<port>`` and, optionally, a replay socket on
    ``tcp://*:<replay_port>``). Each ready pod is registered with ``tcp://<pod IP>:<port>``,
    ``tcp://<pod IP>:<replay_port>`` and ``topic`` as its ``kv_events``."""

    port: int = Field(ge=1, le=65535)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    topic: str = Field(default="", max_length=256)

    @model_validator(mode="after")
    def _distinct(self) -> KubernetesKVEventsSpec:
        if self.replay_port == self.port:
            raise ValueError("replay_port must differ from port")
        return self


class KubernetesTargetSpec(_Strict):
    """The Deployment whose ``scale`` subresource the Kubernetes actuator sets for a pool; its
    ready pods are registered with the gateway as ``http://<pod IP>:<port>``, with where they
    publish KV-cache events when ``kv_events`` is given, e.g.::

        kubernetes: {deployment: vllm-interactive, namespace: tidal, port: 8000,
                     kv_events: {port: 5557, replay_port: 5558}}
    """

    deployment: Name
    namespace: Name = "default"
    port: int = Field(default=8000, ge=1, le=65535)
    kv_events: KubernetesKVEventsSpec | None = None

    @model_validator(mode="after")
    def _ports_apart(self) -> KubernetesTargetSpec:
        if self.kv_events is not None and self.port in (self.kv_events.port, self.kv_events.replay_port):
            raise ValueError("kv_events ports must differ from the HTTP port")
        return self


class CapacityPlanSpec(_Strict):
    """Where ``capacity_from: plan`` takes one replica's capacity (requests/s within the SLO).

    Measured when the scheduler starts, as ``tidal plan`` measures it, by replaying requests
    with log-uniform ``prompt_tokens`` and ``output_tokens`` in the given ranges on the simulated
    replica in virtual time (``preset``, default: the pool's ``sim`` launch preset), or read
    from ``file``, the output of ``tidal plan --json`` (its option with ``tp``, needed when it
    lists several). The SLO is ``ttft_p95_s``/``tpot_p95_s``, by default the ``interactive``
    class's ``ttft_slo_s``/``tpot_slo_s``. Example::

        autoscale: {capacity_from: plan, plan: {preset: llama-3.1-8b-h100, prompt_tokens: [128, 2048]}}
    """

    preset: Name | None = None
    prompt_tokens: tuple[int, int] = (128, 2048)
    output_tokens: tuple[int, int] = (16, 512)
    ttft_p95_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    tpot_p95_s: float | None = Field(default=None, gt=0.0, le=60.0)
    file: str | None = Field(default=None, min_length=1, max_length=4096)
    tp: int | None = Field(default=None, ge=1, le=64)

    @model_validator(mode="after")
    def _check(self) -> CapacityPlanSpec:
        for name, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi <= 10_000_000:
                raise ValueError(f"{name} must be [low, high] with 1 <= low <= high")
        if self.file is not None and self.preset is not None:
            raise ValueError(
                "give 'file' (a tidal plan --json output) or 'preset' (measure at start), not both"
            )
        if self.tp is not None and self.file is None:
            raise ValueError("'tp' picks an option of 'file'; it needs 'file'")
        return self


class AutoscalerSpec(_Strict):
    """Per-pool autoscaling: bounds, the capacity of one replica, the decision policy and events.

    ``policy`` names a registered decision plugin (``reactive`` or ``tidal``); ``parameters``
    are that plugin's, checked strictly when the scheduler starts. A replica's capacity
    (requests/s within the SLO) is ``capacity_rps_per_replica`` (``capacity_from: static``) or
    comes from ``plan`` (``capacity_from: plan``); ``learn_capacity: true`` then refines it from
    the requests per second the pool's replicas sustained within the SLO.
    """

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=8, ge=1, le=10_000)
    capacity_rps_per_replica: float = Field(default=1.0, gt=0)
    capacity_from: Literal["static", "plan"] = "static"
    plan: CapacityPlanSpec | None = None
    learn_capacity: bool = False
    warm_buffer: float = Field(default=0.12, ge=0.0, le=1.0)
    cold_start_s: float = Field(default=180.0, ge=0.0, le=24 * 3600.0)
    scale_down_stabilisation_s: float = Field(default=900.0, ge=0.0, le=7 * 24 * 3600.0)
    decision_interval_s: float = Field(default=15.0, gt=0.0, le=3600.0)
    policy: Name = "tidal"
    parameters: dict[str, Any] = Field(default_factory=dict)
    events: list[ScheduledEventSpec] = Field(default_factory=list, max_length=10_000)
    kubernetes: KubernetesTargetSpec | None = None

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalerSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        if self.plan is not None and self.capacity_from != "plan":
            raise ValueError("'plan' is only read with capacity_from: plan")
        if self.capacity_from == "plan" and "capacity_rps_per_replica" in self.model_fields_set:
            raise ValueError(
                "capacity_from: plan takes the capacity from the plan; drop capacity_rps_per_replica"
            )
        return self

    @property
    def planned(self) -> CapacityPlanSpec:
        """The ``plan`` section (its defaults when ``capacity_from: plan`` gives none)."""
        return self.plan or CapacityPlanSpec()


class CanaryEvalSpec(_Strict):
    """The offline eval each group of a canary rollout is scored on: the ``eval`` job kind's
    dataset (JSONL of ``{"prompt"|"messages", "reference"}``) and scorer, sent by the scheduler
    straight to each group's replicas. ``dataset`` is a path as the scheduler process sees it."""

    dataset: str = Field(min_length=1, max_length=4096)
    scorer: Literal["exact", "contains", "regex"] = "exact"
    pattern: str | None = Field(default=None, max_length=256)
    max_tokens: int = Field(default=64, ge=1, le=8192)
    max_items: int = Field(default=1000, ge=1, le=10_000)


class CanaryRolloutSpec(_Strict):
    """How the scheduler rolls a pool's canary group forward (``tidal scheduler``).

    The canary group gets ``steps`` shares of traffic in turn, each for at least ``step_s`` and
    ``min_requests`` requests; it is rolled back when its error rate is significantly higher than
    the baseline's by more than ``max_error_rate_increase``, or its eval score more than
    ``max_eval_drop`` lower (``eval``; without it, on error rates alone). ``group`` defaults to
    the pool's one replica group that is not ``baseline_group``.
    """

    group: Name | None = None
    baseline_group: Name = "stable"
    steps: list[float] = Field(default_factory=lambda: [0.05, 0.25, 0.5], min_length=1, max_length=100)
    step_s: float = Field(default=300.0, ge=0.0, le=7 * 24 * 3600.0)
    min_requests: int = Field(default=100, ge=0, le=1_000_000_000)
    max_error_rate_increase: float = Field(default=0.01, ge=0.0, le=1.0)
    max_eval_drop: float = Field(default=0.02, ge=0.0, le=1.0)
    interval_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    eval: CanaryEvalSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> CanaryRolloutSpec:
        if any(not 0.0 < s < 1.0 for s in self.steps) or self.steps != sorted(set(self.steps)):
            raise ValueError("steps must be increasing shares strictly between 0 and 1")
        if self.group is not None and self.group == self.baseline_group:
            raise ValueError("group must differ from baseline_group")
        return self


class PoolSpec(_Strict):
    """A group of replicas serving one model for one kind of work.

    ``shared: true`` on an interactive pool lets the batch tier borrow it through the ``shared``
    lane while the scheduler's gate is open. ``region`` (e.g. ``eu-west``) is where its replicas
    run, for features that must stay in some regions.
    """

    name: str = ""  # filled from the mapping key
    kind: PoolKind
    model: Name
    region: Name | None = None
    shared: bool = False
    replicas: list[ReplicaSpec] = Field(default_factory=list, max_length=4096)
    max_inflight_per_replica: int = Field(default=64, ge=1, le=100_000)
    min_inflight_per_replica: int = Field(default=4, ge=1, le=100_000)
    batch_concurrency_per_replica: int = Field(default=256, ge=1, le=100_000)
    autoscale: AutoscalerSpec | None = None
    canary: CanaryRolloutSpec | None = None

    @model_validator(mode="after")
    def _check_caps(self) -> PoolSpec:
        if self.min_inflight_per_replica > self.max_inflight_per_replica:
            raise ValueError("min_inflight_per_replica must not exceed max_inflight_per_replica")
        return self

    @property
    def sim_preset(self) -> str | None:
        """The preset of the pool's first simulated replica (``launch: {kind: sim}``), if any."""
        return next((r.launch.preset for r in self.replicas if r.launch and r.launch.kind == "sim"), None)

    @property
    def canary_group(self) -> str | None:
        """The replica group the scheduler rolls out, if the pool has one (see ``canary``)."""
        if self.canary is not None and self.canary.group is not None:
            return self.canary.group
        baseline = self.canary.baseline_group if self.canary is not None else "stable"
        others = sorted({r.group for r in self.replicas} - {baseline})
        return others[0] if len(others) == 1 else None

    @model_validator(mode="after")
    def _check_canary(self) -> PoolSpec:
        baseline = self.canary.baseline_group if self.canary is not None else "stable"
        others = sorted({r.group for r in self.replicas} - {baseline})
        named = self.canary.group if self.canary is not None else None
        if len(others) > 1 and named is None:
            raise ValueError(
                f"replicas are in several groups besides '{baseline}' ({', '.join(others)}): "
                "name the one to roll out in canary.group"
            )
        return self


class ClassSpec(_Strict):
    """A priority class: how urgent, how long it may wait, how fast its tokens must be.

    ``priority`` is vLLM's request priority: a smaller value is scheduled sooner.
    """

    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    wait_budget_s: float = Field(default=2.0, ge=0.0, le=3600.0)
    tpot_slo_s: float = Field(default=0.05, gt=0.0, le=60.0)
    ttft_slo_s: float = Field(default=1.0, gt=0.0, le=3600.0)


class FeatureSpec(_Strict):
    """A product feature calling the gateway (chat, rag, agent, ...) and its policy.

    ``regions`` keeps its requests and batch lines on pools (and an external provider) in those
    regions: never placed, retried or overflowed elsewhere (absent: anywhere). ``regulated``
    never overflows at all.
    """

    class_: Name = Field(default="interactive", alias="class")
    pool: Name | None = None
    context_cap: int = Field(default=8192, gt=0, le=10_000_000)
    long_context_threshold: int | None = Field(default=None, gt=0)
    regulated: bool = False
    pin_external: bool = False
    regions: list[Name] | None = Field(default=None, min_length=1)

    def allows_region(self, region: str | None) -> bool:
        """Whether work of this feature may run in ``region`` (``None``: a place of unknown region,
        which only a feature without ``regions`` accepts)."""
        return self.regions is None or (region is not None and region in self.regions)

    @model_validator(mode="after")
    def _check(self) -> FeatureSpec:
        if self.regulated and self.pin_external:
            raise ValueError("a regulated feature cannot be pinned to the external provider")
        if self.long_context_threshold is not None and self.long_context_threshold > self.context_cap:
            raise ValueError("long_context_threshold must not exceed context_cap")
        return self


class ExternalProviderSpec(_Strict):
    """An OpenAI-compatible provider that takes overflow (never for regulated features, nor for
    features whose ``regions`` do not include its ``region``)."""

    url: HttpUrl
    api_key_env: str | None = None
    model: str | None = None
    timeout_s: float = Field(default=60.0, gt=0)
    region: Name | None = None
    # ``tidal up`` starts a stand-in at ``url`` (a simulated replica, for trying overflow locally).
    launch: LaunchSpec | None = None


class QuotaSpec(_Strict):
    """A tenant's rate limits across every gateway (absent: no limit). Tokens count the prompt
    and ``max_tokens`` at admission, settled with the real usage when the answer ends."""

    requests_per_minute: int | None = Field(default=None, gt=0, le=1_000_000_000)
    tokens_per_minute: int | None = Field(default=None, gt=0, le=1_000_000_000_000)


class TenantBatchSpec(_Strict):
    """A tenant's bounds in the batch tier (absent: no bound): lines of its unfinished batches
    (a submission that would pass it is refused), and lines of its chunks handed to the broker
    and not yet finished (its other chunks wait their turn, interleaved with other tenants')."""

    max_lines_queued: int | None = Field(default=None, gt=0, le=1_000_000_000)
    max_lines_in_flight: int | None = Field(default=None, gt=0, le=1_000_000_000)


class TenantSpec(_Strict):
    """A tenant, its API keys (stored as ``sha256:<hex>`` hashes) and the features it may use
    (``["*"]`` or none listed: every feature).

    ``weight`` is its share under contention, against the other tenants of the same class
    (admission picks across tenants in proportion; alone, a tenant gets everything); ``quota``
    its rate limits; ``batch`` its bounds in the batch tier."""

    name: Name
    key_hashes: list[str] = Field(default_factory=list)
    features: list[FeatureRef] = Field(default_factory=list)
    admin: bool = False
    weight: float = Field(default=1.0, gt=0.0, le=1000.0)
    quota: QuotaSpec = Field(default_factory=QuotaSpec)
    batch: TenantBatchSpec = Field(default_factory=TenantBatchSpec)

    @field_validator("key_hashes")
    @classmethod
    def _check_hashes(cls, v: list[str]) -> list[str]:
        for h in v:
            algo, _, digest = h.partition(":")
            if algo != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("key hashes must look like 'sha256:<64 lowercase hex digits>'")
        return v


class GateSpec(_Strict):
    """Batch-gate thresholds, with hysteresis (pause above, resume below for ``hold_s``)."""

    queue_wait_p95_pause_s: float = Field(default=0.5, gt=0)
    queue_wait_p95_resume_s: float = Field(default=0.1, ge=0)
    kv_usage_pause: float = Field(default=0.9, gt=0, le=1.0)
    kv_usage_resume: float = Field(default=0.7, ge=0, le=1.0)
    hold_s: float = Field(default=10.0, ge=0)
    sample_interval_s: float = Field(default=0.25, gt=0, le=0.25)

    @model_validator(mode="after")
    def _check(self) -> GateSpec:
        if self.queue_wait_p95_resume_s > self.queue_wait_p95_pause_s:
            raise ValueError("queue_wait_p95_resume_s must not exceed queue_wait_p95_pause_s")
        if self.kv_usage_resume > self.kv_usage_pause:
            raise ValueError("kv_usage_resume must not exceed kv_usage_pause")
        return self


class GatewaySpec(_Strict):
    """Gateway limits: the bounded queue, request sizes and deadlines."""

    max_queue: int = Field(default=256, ge=0, le=1_000_000)
    # Within a class: "fair" across tenants by weight, or "fifo" (one arrival order).
    admission_policy: Literal["fair", "fifo"] = "fair"
    # With fair share, how far over its caps a pool may go for tenants below their share.
    fair_borrow_slots: int = Field(default=2, ge=0, le=10_000)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0, le=1024 * 1024 * 1024)
    # A request's head (request line and headers): at most this many bytes (431 beyond), complete
    # within this many seconds of the connection opening or of its first byte (408 after).
    max_head_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    head_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # A request's body: complete within body_timeout_s of its head, plus a second for every
    # body_min_bytes_per_s bytes that came (408 after; api/protocol.py).
    body_timeout_s: float = Field(default=20.0, gt=0, le=3600)
    body_min_bytes_per_s: int = Field(default=500, ge=1, le=1 << 30)
    # A response the client stops reading: aborted once writes have waited this long on it.
    send_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    scrape_interval_s: float = Field(default=1.0, gt=0, le=60)
    retry_before_first_token: bool = True
    # The replicas' HTTP client: the gateway's lean HTTP/1.1 pool, or aiohttp (measured side by
    # side by `tidal bench gateway`). The external provider always goes through aiohttp.
    upstream_client: Literal["lean", "aiohttp"] = "lean"
    # With TIDAL_REDIS_URL: how often each gateway process publishes its per-replica load and
    # reads the others' (the staleness bound is about two intervals), and how long published
    # counts live (a gateway that dies stops counting after it; counts older are never used).
    shared_state_interval_s: float = Field(default=0.05, gt=0, le=5)
    shared_state_ttl_s: float = Field(default=2.0, gt=0, le=60)
    # Where replicas registered at run time (POST /admin/replicas: the autoscaler, a canary build)
    # may be, their URL and KV-event endpoints alike: host names (shell patterns such as
    # "*.svc.cluster.local") and networks ("10.0.0.0/8", "127.0.0.1"). Empty: any host. Never a
    # link-local, multicast or unspecified address (a cloud's metadata service is link-local).
    # The fleet file's own replicas are configuration and are not checked.
    replica_hosts: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=1024
    )

    @field_validator("replica_hosts")
    @classmethod
    def _check_hosts(cls, v: list[str]) -> list[str]:
        for entry in v:
            if not _HOST_PATTERN.fullmatch(entry) and _network(entry) is None:
                raise ValueError(f"replica_hosts: '{entry}' is neither a host name pattern nor a network")
        return v

    def allows_replica_host(self, host: str) -> bool:
        """Whether a replica registered at run time may be reached at ``host`` (see
        ``replica_hosts``)."""
        host = host.strip("[]").rstrip(".").lower()
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            if any(a.is_link_local or a.is_multicast or a.is_unspecified for a in (ip, mapped) if a):
                return False
        if not self.replica_hosts:
            return True
        for entry in self.replica_hosts:
            net = _network(entry)
            if net is not None:
                if ip is not None and ip.version == net.version and ip in net:
                    return True
            elif ip is None and fnmatch.fnmatchcase(host, entry.lower()):
                return True
        return False

    @model_validator(mode="after")
    def _ttl_outlives_intervals(self) -> GatewaySpec:
        if self.shared_state_ttl_s < 4 * self.shared_state_interval_s:
            raise ValueError("gateway.shared_state_ttl_s must be at least 4 x shared_state_interval_s")
        return self


class PluginSpec(_Strict):
    """One router plugin instance: its registered type, an instance name, typed parameters."""

    type: Name
    name: Name | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class ProfilePluginRef(_Strict):
    ref: Name
    weight: float = Field(default=1.0, ge=0.0, le=1000.0)


class ProfileSpec(_Strict):
    name: Name
    plugins: list[ProfilePluginRef] = Field(min_length=1)


class RouterSpec(_Strict):
    """Router plugins and the profiles that compose them; validated against the registry at start."""

    plugins: list[PluginSpec] = Field(default_factory=list)
    profiles: list[ProfileSpec] = Field(default_factory=list)
    default_profile: Name | None = None


class FleetConfig(_Strict):
    """The whole fleet. Build it with :func:`load_fleet` or :func:`parse_fleet`."""

    models: list[ModelSpec] = Field(min_length=1)
    adapters: list[AdapterSpec] = Field(default_factory=list)
    pools: dict[Name, PoolSpec] = Field(min_length=1)
    classes: dict[Name, ClassSpec] = Field(
        default_factory=lambda: {
            "interactive": ClassSpec(priority=0, wait_budget_s=2.0, tpot_slo_s=0.05),
            "batch": ClassSpec(priority=100, wait_budget_s=3600.0, tpot_slo_s=1.0, ttft_slo_s=3600.0),
        }
    )
    features: dict[Name, FeatureSpec] = Field(default_factory=lambda: {"default": FeatureSpec()})
    tenants: list[TenantSpec] = Field(default_factory=list)
    external_provider: ExternalProviderSpec | None = None
    gate: GateSpec = Field(default_factory=GateSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    router: RouterSpec = Field(default_factory=RouterSpec)

    @model_validator(mode="after")
    def _check_references(self) -> FleetConfig:
        problems: list[str] = []
        model_names = {m.name for m in self.models}
        _dupes(problems, "models", [m.name for m in self.models])
        _dupes(problems, "adapters", [a.name for a in self.adapters])
        _dupes(problems, "tenants", [t.name for t in self.tenants])
        tenant_names = {t.name for t in self.tenants}
        for a in self.adapters:
            if a.base_model not in model_names:
                problems.append(f"adapters.{a.name}.base_model: unknown model '{a.base_model}'")
            for t in a.tenants or ():
                if t not in tenant_names:
                    problems.append(
                        f"adapters.{a.name}.tenants: unknown tenant '{t}' (known: {_known(tenant_names)})"
                    )
        replica_names: list[str] = []
        endpoints: list[str] = []
        for name, pool in self.pools.items():
            pool.name = name
            for r in pool.replicas:
                if r.kv_events is not None:
                    endpoints += [e for e in (r.kv_events.endpoint, r.kv_events.replay_endpoint) if e]
            if pool.model not in model_names:
                problems.append(
                    f"pools.{name}.model: unknown model '{pool.model}' (known: {_known(model_names)})"
                )
            replica_names += [r.name for r in pool.replicas]
            spec = pool.autoscale
            if spec is not None and spec.capacity_from == "plan":
                plan = spec.planned
                if plan.file is None and plan.preset is None and pool.sim_preset is None:
                    problems.append(
                        f"pools.{name}.autoscale.plan: name a preset to measure or a tidal plan --json "
                        "file (no replica of the pool has a sim launch block to take a preset from)"
                    )
        _dupes(problems, "replica names", replica_names)
        _dupes(problems, "kv_events endpoints", endpoints)
        for fname, feat in self.features.items():
            if feat.class_ not in self.classes:
                problems.append(
                    f"features.{fname}.class: unknown class '{feat.class_}' (known: {_known(self.classes)})"
                )
            if feat.pool is not None and feat.pool not in self.pools:
                problems.append(
                    f"features.{fname}.pool: unknown pool '{feat.pool}' (known: {_known(self.pools)})"
                )
            elif feat.pool is not None:
                pool = self.pools[feat.pool]
                if pool.kind in BATCH_ONLY_KINDS:
                    problems.append(
                        f"features.{fname}.pool: '{feat.pool}' is a {pool.kind} pool "
                        "(interactive requests are never placed on batch or spot pools)"
                    )
                if not feat.allows_region(pool.region):
                    problems.append(
                        f"features.{fname}.pool: '{feat.pool}' is in region {_region(pool.region)}, "
                        f"outside the feature's regions ({', '.join(feat.regions or ())})"
                    )
            if feat.pin_external and self.external_provider is None:
                problems.append(f"features.{fname}.pin_external: no external_provider is configured")
            elif feat.pin_external and self.external_provider is not None:
                region = self.external_provider.region
                if not feat.allows_region(region):
                    problems.append(
                        f"features.{fname}.pin_external: the external provider is in region "
                        f"{_region(region)}, outside the feature's regions ({', '.join(feat.regions or ())})"
                    )
        for i, tenant in enumerate(self.tenants):
            for f in tenant.features:
                if f != "*" and f not in self.features:
                    problems.append(
                        f"tenants[{i}].features: unknown feature '{f}' (known: {_known(self.features)})"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # -- convenience lookups -------------------------------------------------------------------

    def pools_of_kind(self, kind: PoolKind) -> list[PoolSpec]:
        return [p for p in self.pools.values() if p.kind == kind]

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def adapter(self, name: str) -> AdapterSpec | None:
        return next((a for a in self.adapters if a.name == name), None)

    def tenant(self, name: str) -> TenantSpec | None:
        """The tenant called ``name``; ``None`` for one the config does not list (the development
        key's): weight 1, no quota, no batch bounds."""
        return next((t for t in self.tenants if t.name == name), None)

    def adapter_for(self, name: str, tenant: str) -> AdapterSpec | None:
        """The adapter ``name`` as ``tenant`` sees it: ``None`` when unknown or bound to others."""
        adapter = self.adapter(name)
        return adapter if adapter is not None and adapter.serves(tenant) else None

    def served_models(self, tenant: str, endpoint: str | None = None) -> set[str]:
        """The names ``tenant`` may ask for: every base model and the adapters it may use; with
        ``endpoint``, only those that can answer it (an embedding model serves ``/v1/embeddings``
        alone, a generative one everything else; an adapter is of its base model's kind)."""
        models = {m.name: m for m in self.models if endpoint is None or m.serves(endpoint)}
        return set(models) | {a.name for a in self.adapters if a.serves(tenant) and a.base_model in models}

    def all_replicas(self) -> list[tuple[PoolSpec, ReplicaSpec]]:
        return [(p, r) for p in self.pools.values() for r in p.replicas]


def _known(names: Any) -> str:
    return ", ".join(sorted(names)) or "none"


def _region(region: str | None) -> str:
    return f"'{region}'" if region is not None else "(none)"


def _dupes(problems: list[str], what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append(f"{what}: duplicate name '{n}'")
        seen.add(n)


# -- API keys ----------------------------------------------------------------------------------


def hash_api_key(key: str) -> str:
    """The stored form of an API key. Keys are random 32-byte tokens, so one SHA-256 suffices."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def verify_api_key(key: str, stored: str) -> bool:
    return hmac.compare_digest(hash_api_key(key), stored)


# -- loading -----------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _format_error(err: Mapping[str, Any]) -> list[str]:
    loc = _format_loc(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return [f"{loc}: unknown key"]
    if err["type"] == "missing":
        return [f"{loc}: required key is missing"]
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "value_error" and "; " in msg and loc == "(top level)":
        return msg.split("; ")
    # Pydantic puts union/function validator names into the location; drop them for readability.
    return [f"{loc}: {msg}"]


def parse_fleet(data: Any, source: str = "<data>") -> FleetConfig:
    """Validate already-parsed YAML/JSON data as a fleet config."""
    if not isinstance(data, Mapping):
        raise FleetConfigError(source, ["(top level): expected a mapping"])
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as exc:
        problems: list[str] = []
        for err in exc.errors():
            problems += _format_error(err)
        raise FleetConfigError(source, problems) from None


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and strictly validate a fleet config file (YAML)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise FleetConfigError(str(p), [f"cannot read: {exc.strerror}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise FleetConfigError(str(p), [f"not valid YAML: {exc}"]) from None
    return _relative_to(parse_fleet(data, str(p)), p.parent)


def _relative_to(fleet: FleetConfig, folder: Path) -> FleetConfig:
    """Read the files a fleet names by relative path (sims' answer keys, canary eval sets) from
    ``folder``, the fleet file's, wherever the process reading it runs."""

    def resolve(path: str) -> str:
        return path if Path(path).is_absolute() else str((folder / path).resolve())

    launches = [r.launch for _, r in fleet.all_replicas()]
    if fleet.external_provider is not None:
        launches.append(fleet.external_provider.launch)
    for launch in launches:
        if launch is not None and launch.answer_key is not None:
            launch.answer_key = resolve(launch.answer_key)
    for pool in fleet.pools.values():
        if pool.canary is not None and pool.canary.eval is not None:
            pool.canary.eval.dataset = resolve(pool.canary.eval.dataset)
    return fleet
