"""The interactive path as one service: registry, router, admission, adapters, scraper and proxy.

Route handlers call :meth:`InteractiveService.prepare` (model, feature, policy, routing keys:
every refusal is an OpenAI-shaped 4xx before anything waits) and return the
:class:`~api.proxy.ProxyResponse` it builds; the admin routes call the replica operations.

Example::

    service = InteractiveService(fleet, settings, prom_registry)
    await service.startup()
    job = service.prepare("/v1/chat/completions", request, principal, headers)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry

from tidal.api.auth import Principal
from tidal.api.errors import APIError
from tidal.api.metrics import GatewayMetrics
from tidal.api.proxy import Proxy, ProxyJob, ProxyResponse
from tidal.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tidal.api.shared_state import AdminFeed, build_shared_load
from tidal.clock import Clock, SystemClock, WallClock
from tidal.fleet import FleetConfig, KVEventsSpec, QuotaSpec, endpoint_host
from tidal.priority.admission import Admission, Outcome
from tidal.priority.features import FEATURE_HEADER, PlanError, estimate_tokens, plan_request, resolve_feature
from tidal.priority.quotas import LocalQuotas, RedisQuotas
from tidal.replicas.client import ReplicaClient
from tidal.router.adapters import AdapterManager
from tidal.router.kv_events import (
    KVEventsEndpoints,
    KVEventsTracker,
    PromptKeys,
    chat_prompt_keys,
    completion_prompt_keys,
    load_prompt_tokenizer,
)
from tidal.router.loader import build_router
from tidal.router.prefix import chat_view, completion_prefix_key, text_blocks
from tidal.router.registry import ReplicaRegistry, ReplicaState
from tidal.router.scraper import MetricsScraper
from tidal.router.types import RouteRequest
from tidal.settings import Settings

__all__ = ["SESSION_HEADER", "InteractiveService"]

SESSION_HEADER = "X-Session-Id"


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _provider_base(url: str) -> str:
    """OpenAI-style provider URLs end in ``/v1``; the replica client adds ``/v1/...`` itself."""
    parts = urlsplit(url.rstrip("/"))
    path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, "", "")).rstrip("/")


class InteractiveService:
    """Everything one gateway process needs to serve interactive requests."""

    def __init__(
        self,
        fleet: FleetConfig,
        settings: Settings,
        prom: CollectorRegistry,
        *,
        clock: Clock | None = None,
        seed: int | None = None,
    ) -> None:
        self.fleet = fleet
        self._models = {m.name: m for m in fleet.models}  # looked up per request
        self.settings = settings
        self.clock = clock or SystemClock()
        self.registry = ReplicaRegistry.from_fleet(fleet, self.clock)
        self.metrics = GatewayMetrics(prom, self.clock)
        # A bad router: section fails here, at start, with every offending key named.
        self.router = build_router(fleet.router, clock=self.clock, seed=seed, observer=self.metrics)
        self.admission = Admission(
            capacity=self.registry,
            clock=self.clock,
            max_queue=fleet.gateway.max_queue,
            overflow_available=fleet.external_provider is not None,
            on_outcome=self.metrics.outcome,
            policy=fleet.gateway.admission_policy,
            weight=self._tenant_weight,
            remote_inflight=self._remote_tenant_inflight,
            on_push_out=lambda ticket: self.proxy.pushed_out(ticket),
            on_tenant_outcome=self.metrics.tenant_outcome,
            borrow_slots=fleet.gateway.fair_borrow_slots,
        )
        self.metrics.attach_live(self.registry, self.admission)
        self.adapters = AdapterManager(
            self.registry,
            {a.name: a.path for a in fleet.adapters},
            on_evict=lambda replica, _: self.metrics.adapter_evictions.labels(replica).inc(),
        )
        self.scraper = MetricsScraper(
            self.registry, interval_s=fleet.gateway.scrape_interval_s, clock=self.clock
        )
        self.external: ReplicaClient | None = None
        provider = fleet.external_provider
        if provider is not None:
            key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
            self.external = ReplicaClient(
                _provider_base(str(provider.url)),
                api_key=key,
                read_timeout=provider.timeout_s,
                name="external",
                transport="aiohttp",
            )
        self.proxy = Proxy(
            registry=self.registry,
            router=self.router,
            admission=self.admission,
            adapters=self.adapters,
            metrics=self.metrics,
            clock=self.clock,
            external=self.external,
            external_model=provider.model if provider else None,
            retry_before_first_token=fleet.gateway.retry_before_first_token,
            # Quotas count in Redis for every gateway when it is configured, else here.
            quotas=(
                RedisQuotas(settings.redis_url, WallClock(), namespace=settings.redis_namespace)
                if settings.redis_url
                else LocalQuotas(self.clock)
            ),
            quota_of=self._tenant_quota,
        )
        # With TIDAL_REDIS_URL, every gateway process's load per replica, queues and caps are
        # shared (router.shared); a slot freed at another gateway wakes this one's queue.
        self.shared = build_shared_load(
            settings,
            fleet,
            self.registry,
            self.admission,
            self.proxy.slot_freed,
            prom,
            self.clock,
            pool_rates=self._pool_rates,
            counters=self._group_counts,
        )
        default = self.router.profiles[self.router.default]
        # Block hashes cost time per request; compute them only when the profile reads them.
        self.needs_blocks = any(p.READS_BLOCKS for p in default.producers)
        # Replicas that push KV events get an exact block index (router.kv_events); prompts are
        # tokenised for it only for models with a tokenizer, in pools where someone publishes.
        self.kv_events = KVEventsTracker(self.clock)
        prom.register(self.kv_events)
        self._kv_pools: dict[str, int] = {}
        self._tokenizers = {m.name: load_prompt_tokenizer(m.tokenizer) for m in fleet.models if m.tokenizer}
        for state in self.registry:
            self.metrics.replica_added(state.name)
        for _, replica in fleet.all_replicas():
            if replica.kv_events is not None:
                k = replica.kv_events
                self._subscribe(replica.name, k)
        self._scrape_task: asyncio.Task[None] | None = None
        self._shared_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Admin changes made at another gateway process reach this one (and this one's reach
        # them) through Redis, alongside the shared load.
        self.admin_feed: AdminFeed | None = None
        if self.shared is not None and settings.redis_url:
            self.admin_feed = AdminFeed(
                settings.redis_url,
                namespace=settings.redis_namespace,
                origin=self.shared.store.gateway_id,
                apply=self.apply_admin,
            )
        self._admin_task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def _client_for(self, state: ReplicaState) -> ReplicaClient:
        return ReplicaClient(state.url, name=state.name, transport=self.fleet.gateway.upstream_client)

    async def startup(self) -> None:
        for state in self.registry:
            if state.client is None:
                state.client = self._client_for(state)
        loop = asyncio.get_running_loop()
        self._scrape_task = loop.create_task(self.scraper.run_forever())
        self.kv_events.start()
        if self.shared is not None:
            await self.shared.sync_once()  # start from the fleet's counts and caps, not from zero
            self._shared_task = loop.create_task(self.shared.run_forever())
        if self.admin_feed is not None:
            self._admin_task = loop.create_task(self.admin_feed.run_forever())

    async def shutdown(self) -> None:
        tasks = [
            t
            for t in (self._scrape_task, self._shared_task, self._admin_task, *self._background)
            if t is not None
        ]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.kv_events.stop()
        for state in self.registry:
            if isinstance(state.client, ReplicaClient):
                await state.client.aclose()
        if self.external is not None:
            await self.external.aclose()
        if self.shared is not None:
            await self.shared.leave()  # the others stop counting this gateway's requests at once
            await self.shared.store.aclose()
        if self.admin_feed is not None:
            await self.admin_feed.aclose()

    def _subscribe(self, name: str, spec: KVEventsSpec) -> None:
        endpoints = KVEventsEndpoints(spec.endpoint, spec.replay_endpoint, spec.topic)
        state = self.registry.get(name)
        if state is None:
            return
        state.kv_events = self.kv_events.add(name, endpoints)
        self._kv_pools[state.pool] = self._kv_pools.get(state.pool, 0) + 1

    # -- requests ---------------------------------------------------------------------------------

    def _model(self, name: str, tenant: str, path: str) -> tuple[str, str | None]:
        """The base model and adapter ``name`` stands for, when it can answer ``path`` (an
        embedding model serves ``/v1/embeddings`` alone, a generative one everything else)."""
        spec, adapter = self._models.get(name), None
        if spec is None:
            # An adapter bound to other tenants does not exist for this one: the same 404, no load.
            bound = self.fleet.adapter_for(name, tenant)
            spec = self._models.get(bound.base_model) if bound is not None else None
            if bound is None or spec is None:
                raise APIError(
                    404,
                    f"The model '{name[:200]}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            adapter = bound.name
        if not spec.serves(path):
            kind = "an embedding model" if spec.embedding else "not an embedding model"
            raise APIError(
                400,
                f"The model '{name[:200]}' does not serve {path}: it is {kind}.",
                param="model",
                code="model_not_supported",
            )
        return spec.name, adapter

    def _tenant_weight(self, tenant: str) -> float:
        spec = self.fleet.tenant(tenant)
        return spec.weight if spec is not None else 1.0

    def _tenant_quota(self, tenant: str) -> QuotaSpec | None:
        spec = self.fleet.tenant(tenant)
        return spec.quota if spec is not None else None

    def _remote_tenant_inflight(self, pool: str, tenant: str) -> int:
        shared = self.shared
        return shared.remote_tenants.get((pool, tenant), 0) if shared is not None else 0

    def prepare(
        self,
        path: str,
        request: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
        principal: Principal,
        headers: Mapping[str, str],
    ) -> ProxyResponse:
        """Check, plan and key one request; every refusal raises an OpenAI-shaped :class:`APIError`."""
        arrived = self.clock.now()
        base, adapter = self._model(request.model, principal.tenant, path)
        body = request.model_dump(exclude_unset=True, exclude_none=True)
        body["model"] = request.model
        prefix_key: int | None
        blocks: tuple[int, ...] = ()
        limit: int | None
        if isinstance(request, ChatCompletionRequest):
            view = chat_view(body["messages"], body.get("tools"), blocks=self.needs_blocks)
            size, prefix_key, blocks = view.size, view.prefix_key, view.blocks
            limit = request.token_limit
            stream = request.stream
        else:
            items = request.prompt if isinstance(request, CompletionRequest) else request.input
            size = _prompt_size(items)
            prefix_key = completion_prefix_key(items)
            if self.needs_blocks and isinstance(items, str):
                blocks = text_blocks(items)
            limit = request.max_tokens if isinstance(request, CompletionRequest) else None
            if isinstance(request, CompletionRequest) and limit is None:
                limit = 16  # the OpenAI and vLLM default for completions
            stream = isinstance(request, CompletionRequest) and request.stream
        try:
            feature = resolve_feature(
                self.fleet, headers.get(FEATURE_HEADER), principal.features, principal.default_feature
            )
            plan = plan_request(
                self.fleet, feature, model=base, prompt_tokens=estimate_tokens(size), max_tokens=limit
            )
        except PlanError as exc:
            if exc.code == "context_length_exceeded":
                spec = self.fleet.features[feature]
                self.admission.count(spec.class_, feature, Outcome.CONTEXT_CAP)
            raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
        if adapter is not None and plan.pool is not None:
            pool = plan.pool
            if not any(s.max_loras > 0 or adapter in s.adapters for s in self.registry.in_pool(pool)):
                raise APIError(
                    404,
                    f"The adapter '{adapter}' cannot be served: no replica of the '{pool}' pool takes LoRA adapters.",
                    param="model",
                    code="model_not_found",
                )
        if plan.pool is not None:
            body["priority"] = plan.class_spec.priority
        engine_keys: PromptKeys | None = None
        tokenizer = self._tokenizers.get(base)
        if tokenizer is not None and self.needs_blocks and plan.pool in self._kv_pools:
            salt = body.get("cache_salt")
            salt = salt if isinstance(salt, str) else None
            if isinstance(request, ChatCompletionRequest):
                engine_keys = chat_prompt_keys(tokenizer, body["messages"], adapter=adapter, salt=salt)
            elif isinstance(request, CompletionRequest):
                engine_keys = completion_prompt_keys(tokenizer, request.prompt, adapter=adapter, salt=salt)
        session = headers.get(SESSION_HEADER) or request.user
        route = RouteRequest(
            model=base,
            adapter=adapter,
            prefix_key=prefix_key,
            prefix_blocks=blocks,
            session_key=session[:256] if session else None,
            prompt_tokens=plan.prompt_tokens,
            regions=plan.regions,
            engine_keys=engine_keys,
        )
        job = ProxyJob(path, body, stream, plan, route, adapter, arrived, tenant=principal.tenant)
        return ProxyResponse(job, self.proxy.run)

    # -- admin ------------------------------------------------------------------------------------

    def replica_json(self, state: ReplicaState) -> dict[str, Any]:
        snap = state.snapshot
        now = self.clock.now()
        out: dict[str, Any] = {
            "name": state.name,
            "url": state.url,
            "pool": state.pool,
            "group": state.group,
            "weight": state.weight,
            "healthy": state.healthy,
            "draining": state.draining,
            "inflight": state.inflight,
            "cap": state.cap.value,
            "loaded_adapters": sorted(state.adapters),
            "snapshot": None
            if snap is None
            else {
                "num_running": snap.num_running,
                "num_waiting": snap.num_waiting,
                "kv_cache_usage": snap.kv_cache_usage,
                "prefix_cache_queries": snap.prefix_cache_queries,
                "prefix_cache_hits": snap.prefix_cache_hits,
                "num_preemptions": snap.num_preemptions,
                "generation_tokens": snap.generation_tokens,
                "running_lora_adapters": sorted(snap.running_lora_adapters),
                "waiting_lora_adapters": sorted(snap.waiting_lora_adapters),
            },
            "snapshot_age_s": None if state.snapshot_at is None else round(now - state.snapshot_at, 3),
        }
        if self.shared is not None:
            out["inflight_all"] = state.inflight + state.remote_inflight  # every gateway's requests
        out["kv_events"] = self.kv_events.summary(state.name)
        return out

    def add_replica(
        self,
        *,
        name: str,
        url: str,
        pool: str,
        group: str,
        weight: float,
        max_loras: int,
        kv_events: KVEventsSpec | None = None,
    ) -> ReplicaState:
        spec = self.fleet.pools.get(pool)
        if spec is None:
            raise APIError(
                400,
                f"Unknown pool '{pool}' (known: {', '.join(sorted(self.fleet.pools))}).",
                param="pool",
                code="unknown_pool",
            )
        if self.registry.get(name) is not None:
            raise APIError(
                409, f"A replica named '{name}' already exists.", param="name", code="replica_exists"
            )
        endpoints = [("url", url)]
        if kv_events is not None:
            endpoints += [("kv_events.endpoint", kv_events.endpoint)]
            if kv_events.replay_endpoint is not None:
                endpoints += [("kv_events.replay_endpoint", kv_events.replay_endpoint)]
        for param, endpoint in endpoints:
            host = endpoint_host(endpoint)
            if host is not None and not self.fleet.gateway.allows_replica_host(host):
                raise APIError(
                    400,
                    f"The gateway does not reach '{host}': not a host its configuration allows for "
                    "replicas (gateway.replica_hosts; never link-local, multicast or unspecified).",
                    param=param,
                    code="replica_host_refused",
                )
        slo = min(c.tpot_slo_s for c in self.fleet.classes.values())
        state = ReplicaState(
            name=name,
            url=url.rstrip("/"),
            pool=pool,
            model=spec.model,
            cap=ReplicaRegistry.new_cap(spec, slo, self.clock),
            group=group,
            weight=weight,
            max_loras=max_loras,
            region=spec.region,  # a replica is where its pool is
        )
        state.client = self._client_for(state)
        self.registry.add(state)
        self.metrics.replica_added(name)
        if kv_events is not None:
            self._subscribe(name, kv_events)
        self.proxy.slot_freed(pool)
        return state

    def patch_replica(
        self, name: str, *, healthy: bool | None, draining: bool | None, weight: float | None
    ) -> ReplicaState:
        state = self.replica(name)
        if weight is not None:
            state.weight = weight
        if draining is not None:
            state.draining = draining
        if healthy is not None:
            state.healthy = healthy
            if not healthy:
                # Fail fast: before the first token the proxy retries elsewhere; after it the
                # client's stream ends with a retryable error event.
                for handle in list(state.handles):
                    handle.abort(f"replica {name} was marked unhealthy")
        self.proxy.slot_freed(state.pool)
        return state

    def replica(self, name: str) -> ReplicaState:
        """The replica called ``name``; 404 when there is none."""
        state = self.registry.get(name)
        if state is None:
            raise APIError(404, f"No replica named '{name[:200]}'.", param="name", code="replica_not_found")
        return state

    async def apply_admin(self, op: str, data: dict[str, Any]) -> None:
        """Apply an admin change another gateway process made (:class:`~api.shared_state.AdminFeed`):
        what its ``/admin`` call did here, less what it did once for all (the batch tier's
        record). A change that no longer applies (the name exists, or is gone) is skipped."""
        name = str(data.get("name", ""))
        state = self.registry.get(name)
        if op == "register" and state is None:
            k = data.get("kv_events")
            self.add_replica(
                name=name,
                url=str(data["url"]),
                pool=str(data["pool"]),
                group=str(data.get("group", "stable")),
                weight=float(data.get("weight", 1.0)),
                max_loras=int(data.get("max_loras", 0)),
                kv_events=KVEventsSpec.model_validate(k) if k else None,
            )
        elif op == "patch" and state is not None:
            self.patch_replica(
                name, healthy=data.get("healthy"), draining=data.get("draining"), weight=data.get("weight")
            )
        elif op == "remove" and state is not None:
            task = asyncio.get_running_loop().create_task(
                self.remove_replica(name, float(data.get("timeout_s", 30.0)))
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def share_admin(self, op: str, data: dict[str, Any]) -> None:
        """Tell the other gateway processes about an admin change made here (when they share)."""
        if self.admin_feed is not None:
            await self.admin_feed.publish(op, data)

    async def remove_replica(self, name: str, timeout_s: float) -> tuple[bool, int]:
        """Drain (no new requests, in-flight ones finish), then deregister. Returns ``(removed,
        inflight)``; when the drain outlasts ``timeout_s`` the removal finishes in the background."""
        state = self.replica(name)
        state.draining = True
        deadline = time.monotonic() + timeout_s
        while state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.inflight > 0:
            task = asyncio.get_running_loop().create_task(self._remove_when_drained(state))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return False, state.inflight
        await self._deregister(state)
        return True, 0

    async def _remove_when_drained(self, state: ReplicaState) -> None:
        while state.inflight > 0 and not state.removed:
            await asyncio.sleep(0.1)
        if not state.removed:
            await self._deregister(state)

    async def _deregister(self, state: ReplicaState) -> None:
        if self.registry.get(state.name) is state:
            self.registry.remove(state.name)
            self.router.forget(state.name)
            self.metrics.replica_removed(state.name)
        if state.kv_events is not None and state.name in self.kv_events:
            await self.kv_events.remove(state.name)
            left = self._kv_pools.get(state.pool, 0) - 1
            if left > 0:
                self._kv_pools[state.pool] = left
            else:
                self._kv_pools.pop(state.pool, None)
        if isinstance(state.client, ReplicaClient):
            await state.client.aclose()

    def _pool_rates(self) -> dict[str, tuple[float, float]]:
        """This process's requests and errors per second per pool (published to the others)."""
        out = {}
        for pool in self.registry.pools():
            w = self.metrics.pool(pool)
            out[pool] = (w.requests.rate(), w.errors.rate())
        return out

    def _group_counts(self) -> dict[str, int]:
        """This process's requests and errors per replica group (added up across processes)."""
        out = {}
        for name, g in self.metrics.groups.items():
            out[f"group:{name}:requests"], out[f"group:{name}:errors"] = g.requests, g.errors
        return out

    def load_json(self) -> dict[str, Any]:
        """The scheduler's signal source (``GET /admin/load``), cheap enough to poll every 250 ms.

        ``scope`` says what its counts cover: ``fleet`` while this gateway shares load state with
        the others (queue depth, in flight and the request and error rates then count every
        gateway process's, so any one answers for all: one port of ``--workers N``, or one of
        several gateways), ``gateway`` when it counts its own alone (no Redis, or Redis lost for
        longer than the shared state's ttl).
        A canary group's ``requests`` and ``errors`` (counters since the start) are every
        process's too once this one has synced with the others (whatever the scope: what this one
        counted while the store was away is added, so they only grow); its ``error_rate``, the
        latency quantiles and KV usage are this process's own view."""
        # The others' counts are in use until they are older than the store's ttl (then dropped).
        fleet = self.shared is not None and self.shared.age_s() <= self.shared.ttl_s
        local = self._pool_rates()
        pools: dict[str, Any] = {}
        for pool in self.registry.pools():
            states = self.registry.in_pool(pool)
            snaps = [s.snapshot for s in states if s.snapshot is not None and s.healthy]
            kv = [s.kv_cache_usage for s in snaps]
            w = self.metrics.pool(pool)
            rps, eps = local[pool]
            if fleet:
                assert self.shared is not None
                remote_rps, remote_eps = self.shared.remote_rates.get(pool, (0.0, 0.0))
                rps, eps = rps + remote_rps, eps + remote_eps
            remote_queued = self.shared.remote_queued.get(pool, 0) if self.shared is not None else 0
            pools[pool] = {
                # With shared state, queue depth and in-flight count every gateway's requests.
                "queue_depth": self.admission.queue_depth(pool) + remote_queued,
                "queue_wait_p95_s": _finite(self.admission.queue_wait_quantile(pool, 0.95)),
                "ttft_p95_s": _finite(w.ttft.quantile(0.95)),
                "tpot_p95_s": _finite(w.tpot.quantile(0.95)),
                "inflight": sum(s.inflight + s.remote_inflight for s in states),
                "kv_cache_usage_max": max(kv) if kv else None,
                "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
                "num_waiting": sum(s.num_waiting for s in snaps),
                "replicas_healthy": sum(1 for s in states if s.healthy and not s.draining),
                # Those taking traffic: a canary rolled back to weight 0 is healthy, not capacity.
                "replicas_serving": sum(1 for s in states if s.routable),
                "replicas_total": len(states),
                "requests_per_s": rps,
                "error_rate": min(1.0, eps / rps) if rps > 0 else 0.0,
            }
        groups: dict[str, Any] = {}
        for name, g in self.metrics.groups.items():
            assert g.window_requests is not None and g.window_errors is not None
            recent = g.window_requests.count()
            groups[name] = {
                "requests": g.requests,
                "errors": g.errors,
                "error_rate": g.window_errors.count() / recent if recent else 0.0,
            }
        shared = self.shared
        totals = shared.fleet_totals() if shared is not None else None
        for key, n in (totals or {}).items():
            head, _, what = key.rpartition(":")
            if head.startswith("group:") and what in ("requests", "errors"):
                group = groups.setdefault(head[6:], {"requests": 0, "errors": 0, "error_rate": 0.0})
                group[what] = n
        for state in self.registry:
            groups.setdefault(state.group, {"requests": 0, "errors": 0, "error_rate": 0.0})
        out: dict[str, Any] = {
            "time": time.time(),
            "scope": "fleet" if fleet else "gateway",
            "pools": pools,
            # (the groups' counts are every process's from the first sync on, whatever "scope")
            "groups_scope": "fleet" if totals is not None else "gateway",
            "groups": groups,
        }
        if shared is not None:
            out["shared_state"] = {
                "up": shared.up,
                "age_s": _finite(shared.age_s()),
                "gateways": shared.gateways,
            }
        return out


def _prompt_size(items: Any) -> int:
    """Bytes of the largest prompt in a completion/embedding request (ids count 4 bytes each)."""
    if isinstance(items, str):
        return len(items.encode())
    if isinstance(items, list) and items:
        if isinstance(items[0], int):
            return 4 * len(items)
        return max(_prompt_size(x) for x in items)
    return 0
