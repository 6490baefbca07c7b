"""The simulated replica's HTTP server: vLLM's OpenAI-compatible API on a real-time clock.

A raw ASGI app under uvicorn (uvloop, httptools): no framework and no pydantic per token. One
engine task per process runs the steps: it schedules a step, sleeps until the step's deadline
(``begin + modelled duration / time_scale``, deadline-based so its own processing time does not
add up), then hands each request's new token to that request's stream, which writes SSE bytes
built from cached pieces. A client that disconnects aborts its request, as vLLM does.

Routes (as vLLM 0.33 registers them for the preset's kind of model): ``POST
/v1/chat/completions`` and ``/v1/completions`` (generative presets) or ``/v1/embeddings``
(embedding presets), ``GET /v1/models``, ``/health``, ``/metrics``, ``/version``, ``POST
/tokenize``, ``/detokenize``, and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(unless runtime LoRA updating is off), ``GET /kv_event_sources``, and ``POST /reset_prefix_cache``
(only in dev mode, ``VLLM_SERVER_DEV_MODE=1``, as vLLM). Bad input gets vLLM's status codes and
error shape.

With ``kv_events`` (vLLM's ``--kv-events-config``) the engine's block pool publishes vLLM's KV
events on a ZMQ PUB socket with a replay socket (:mod:`replicas.wire.kv_events`): one batch per
step that cached or evicted blocks, block hashes in vLLM's scheme for the same token ids.

Example::

    app = SimServer(ServerConfig(preset="tiny-cpu", served_model_names=["tiny"]))
    uvicorn.run(app, port=8000, loop="uvloop", http="httptools")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import Metric
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidal.logs import ACCESS, uvicorn_log_config
from tidal.replicas.sim.engine import SimEngine, StepOutput
from tidal.replicas.sim.request import Request, RequestStatus
from tidal.replicas.sim.tokenizer import (
    AnswerKey,
    SimTokenizer,
    TextModel,
    flatten_messages,
    load_tokenizer,
    stable_hash,
)
from tidal.replicas.wire.kv_events import HASH_ALGOS, KVEventPublisher, KVEventsConfig
from tidal.replicas.wire.prom import Histogram, counter_family, gauge_family, histogram_family, summary_family

__all__ = ["ServerConfig", "SimServer", "serve"]

log = logging.getLogger("tidal.sim")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_KINDS = ("batch", "interactive")
SIM_VERSION = "0.33.0"  # the vLLM API version the simulator speaks
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass
class ServerConfig:
    """Everything ``tidal sim`` configures (see ``tidal sim --help``)."""

    preset: str
    served_model_names: list[str] = field(default_factory=list)
    seed: int = 0
    time_scale: float = 1.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_loras: int | None = None
    num_gpu_blocks: int | None = None
    scheduling_policy: str = "priority"
    enable_prefix_caching: bool = True
    tokenizer: str | None = None
    runtime_lora: bool = True
    error_rate: float = 0.0
    answer_key: str | None = None
    accuracy: float = 1.0
    output_len_median: int = 256
    natural_stop_always: bool = False
    max_num_queued_reqs: int = 4096
    max_request_bytes: int = 16 * 1024 * 1024
    max_n: int = 16
    api_key: str | None = None
    root: str | None = None  # what /v1/models shows as the base model's root
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config
    prefix_caching_hash_algo: str = "sha256"
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: /reset_prefix_cache

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError("time_scale must be positive")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError("accuracy must be within [0, 1]")
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError("scheduling_policy must be 'priority' or 'fcfs'")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}")


# -- request bodies (validated once per request, as vLLM's pydantic models do) ------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = 1
    priority: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    request_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_tokens: int = 0


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class _ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None


class _CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False


class _EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = None
    encoding_format: str = "float"
    priority: int = 0


class _LoadLoRABody(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=4096)
    load_inplace: bool = False


class _UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(max_length=256)
    lora_int_id: int | None = None


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


# -- errors ------------------------------------------------------------------------------------


class HTTPError(Exception):
    """An error answer in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}
        ).encode()


def _bad_request(message: str, param: str | None = None, value: Any = None) -> HTTPError:
    # vLLM's VLLMValidationError appends "(parameter=..., value=...)" to the message.
    suffix = ""
    if param is not None:
        suffix = f" (parameter={param}" + (f", value={value})" if value is not None else ")")
    return HTTPError(400, message + suffix, "BadRequestError", param)


def _sanitize(v: Any) -> Any:
    if isinstance(v, dict):
        return f"<dict of {len(v)} items>"
    if isinstance(v, list):
        return f"<list of {len(v)} items>"
    return v


def _validation_error(exc: ValidationError) -> HTTPError:
    errs = exc.errors(include_url=False)
    parts = []
    for e in errs:
        d: dict[str, Any] = {
            "type": e["type"],
            "loc": ".".join(["body", *(str(x) for x in e["loc"])]),
            "msg": e["msg"],
            "input": _sanitize(e.get("input")),
        }
        if e.get("ctx"):
            d["ctx"] = {k: str(v) for k, v in e["ctx"].items()}
        parts.append(repr(d))
    n = len(errs)
    msg = f"{n} validation error{'s' if n != 1 else ''}:\n  " + "\n  ".join(parts)
    param = ".".join(["body", *(str(x) for x in errs[0]["loc"])]) if errs else None
    return HTTPError(400, msg, "Bad Request", param)


def _json_error(exc: json.JSONDecodeError) -> HTTPError:
    d = {
        "type": "json_invalid",
        "loc": f"body.{exc.pos}",
        "msg": "JSON decode error",
        "input": "<dict of 0 items>",
        "ctx": {"error": exc.msg},
    }
    return HTTPError(400, f"1 validation error:\n  {d!r}", "Bad Request", f"body.{exc.pos}")


# -- streams -----------------------------------------------------------------------------------


class _Stream:
    """Where the engine task leaves one request's tokens for its handler."""

    __slots__ = ("choice", "done", "finish_reason", "forced", "items", "ready", "request", "waiter")

    def __init__(self, choice: int) -> None:
        self.choice = choice
        self.forced: list[int] | None = None  # the answer key's tokens, then end-of-turn
        self.items: deque[int] = deque()
        self.done = False
        self.finish_reason: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.request: Request | None = None
        self.ready = False  # something new (a token, the end) the handler has not looked at

    def wake(self) -> None:
        self.ready = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class _Group:
    """All choices (``n``) of one HTTP request and the event its handler waits on."""

    __slots__ = ("streams", "waiter")

    def __init__(self, n: int) -> None:
        self.streams = [_Stream(i) for i in range(n)]
        self.waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Until some choice has news; the caller then looks at every choice (clearing ``ready``)."""
        if any(s.ready for s in self.streams):
            for s in self.streams:
                s.ready = False
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiter = fut
        for s in self.streams:
            s.waiter = fut
        try:
            await fut
        finally:
            self.waiter = None
            for s in self.streams:
                s.waiter = None
                s.ready = False


# -- HTTP metrics (what prometheus_fastapi_instrumentator adds to vLLM's page) -----------------

_HTTP_EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
_HIGHR_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)
_LOWR_BUCKETS = (0.1, 0.5, 1.0)


class _HTTPMetrics:
    """The HTTP families of vLLM's page, as prometheus_fastapi_instrumentator exposes them (a
    ``prometheus_client`` collector)."""

    def __init__(self) -> None:
        self.created = time.time()
        self.requests: dict[tuple[str, str, str], int] = {}
        self.req_size: dict[str, list[int]] = {}  # handler: [requests, bytes]
        self.resp_size: dict[str, list[int]] = {}
        self.highr = Histogram(_HIGHR_BUCKETS)
        self.lowr: dict[tuple[str, str], Histogram] = {}

    def observe(
        self, handler: str, method: str, status: int, req_bytes: int, resp_bytes: int, dt: float
    ) -> None:
        if handler in _HTTP_EXCLUDED:
            return
        key = (handler, method, f"{status // 100}xx")
        self.requests[key] = self.requests.get(key, 0) + 1
        for d, n in ((self.req_size, req_bytes), (self.resp_size, resp_bytes)):
            s = d.setdefault(handler, [0, 0])
            s[0] += 1
            s[1] += n
        self.highr.observe(dt)
        lo = self.lowr.get((handler, method))
        if lo is None:
            lo = self.lowr[(handler, method)] = Histogram(_LOWR_BUCKETS)
        lo.observe(dt)

    def collect(self) -> Iterator[Metric]:
        c = self.created
        yield counter_family(
            "http_requests",
            "Total number of requests by method, status and handler.",
            [({"handler": h, "method": m, "status": s}, n) for (h, m, s), n in self.requests.items()],
            created=c,
        )
        for name, what, d in (
            (
                "http_request_size_bytes",
                "Content length of incoming requests by handler. Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                self.req_size,
            ),
            (
                "http_response_size_bytes",
                "Content length of outgoing responses by handler. Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                self.resp_size,
            ),
        ):
            yield summary_family(
                name, what, [({"handler": h}, n, total) for h, (n, total) in d.items()], created=c
            )
        yield histogram_family(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
            [({}, self.highr)],
            created=c,
        )
        yield histogram_family(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
            [({"handler": h, "method": m}, lo) for (h, m), lo in self.lowr.items()],
            created=c,
        )


class _SimMetrics:
    """The simulator's own families (not vLLM's): how well the real-time loop keeps time, and
    requests per kind of work (batch or interactive, from the request id). A collector."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        srv = self.server
        model = {"model_name": srv.served_names[0]}
        sched = srv.engine.scheduler
        running = dict.fromkeys(REQUEST_KINDS, 0)
        waiting = dict.fromkeys(REQUEST_KINDS, 0)
        for r in sched.running:
            running[_kind(r.request_id)] += 1
        for r in sched.waiting:
            waiting[_kind(r.request_id)] += 1

        def by_kind(values: Mapping[str, float]) -> list[tuple[dict[str, str], float]]:
            return [({**model, "kind": k}, values[k]) for k in REQUEST_KINDS]

        yield counter_family(
            "tidal_sim_steps", "Engine steps run by the simulated replica.", [(model, srv.steps)]
        )
        yield counter_family(
            "tidal_sim_step_model_seconds",
            "Step time the cost model asked for (model seconds).",
            [(model, srv.model_step_seconds)],
        )
        yield counter_family(
            "tidal_sim_step_actual_seconds",
            "Step time actually taken (model seconds).",
            [(model, srv.wall_step_seconds)],
        )
        yield counter_family(
            "tidal_sim_step_lateness_seconds",
            "How late steps ended after their deadline (model seconds).",
            [(model, srv.lateness_seconds)],
        )
        yield counter_family(
            "tidal_sim_requests",
            "Requests received, by kind (batch: X-Request-Id batch-*).",
            by_kind(srv.arrivals),
        )
        yield gauge_family(
            "tidal_sim_last_arrival_timestamp_seconds",
            "Unix time of the last request of each kind.",
            by_kind(srv.last_arrival),
        )
        yield gauge_family(
            "tidal_sim_requests_running", "Requests in the running batch, by kind.", by_kind(running)
        )
        yield gauge_family(
            "tidal_sim_requests_waiting", "Requests waiting to be scheduled, by kind.", by_kind(waiting)
        )


def _page_registry(server: SimServer) -> CollectorRegistry:
    """What ``/metrics`` shows, in vLLM's order: the default collectors (python_gc_*,
    python_info, process_*), the HTTP families, the engine's, then the simulator's own."""
    reg = CollectorRegistry()
    GCCollector(registry=reg)
    PlatformCollector(registry=reg)
    ProcessCollector(registry=reg)
    reg.register(server.http_metrics)
    reg.register(server.engine.metrics_registry)
    reg.register(_SimMetrics(server))
    return reg


# -- the server --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    """One HTTP request as a handler sees it (the body already read, within the size limit)."""

    scope: Scope
    body: bytes
    headers: Mapping[str, str]
    receive: Receive
    send: Send


Handler = Callable[[_Call], Awaitable[tuple[int, int]]]


class SimServer:
    """The ASGI application of one simulated replica (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        cfg = config
        self.tokenizer: SimTokenizer = load_tokenizer(cfg.tokenizer)
        self.text_model = TextModel(
            self.tokenizer,
            seed=cfg.seed,
            answer_key=AnswerKey.load(cfg.answer_key) if cfg.answer_key else None,
            accuracy=cfg.accuracy,
            output_len_median=cfg.output_len_median,
        )
        names = cfg.served_model_names or [cfg.preset]
        self.served_names = names
        self.engine = SimEngine(
            cfg.preset,
            seed=cfg.seed,
            token_source=self._next_token,
            served_model_name=names[0],
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            max_loras=cfg.max_loras,
            num_gpu_blocks=cfg.num_gpu_blocks,
            policy=cfg.scheduling_policy,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_kv_cache_events=cfg.kv_events is not None and cfg.kv_events.enabled,
            prefix_caching_hash_algo=cfg.prefix_caching_hash_algo,
        )
        self.publisher: KVEventPublisher | None = None
        self.max_model_len = self.engine.config.max_model_len
        self.embedding = self.engine.preset.is_embedding
        self.http_metrics = _HTTPMetrics()
        self.metrics_registry = _page_registry(self)
        self._rng = random.Random(cfg.seed)
        self._t0 = time.perf_counter()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._text_cache: dict[int, str] = {}
        self.fingerprint = f"tidal-sim-{SIM_VERSION}-{cfg.seed}"
        self.created_at = int(time.time())
        # Real-time accounting: modelled step time vs how long steps really took.
        self.steps = 0
        self.model_step_seconds = 0.0
        self.wall_step_seconds = 0.0
        self.lateness_seconds = 0.0
        # Per kind of work (batch lines carry an X-Request-Id starting ``batch-``): arrivals and
        # the wall time of the last one, so a benchmark can see when batch stopped coming.
        self.arrivals = dict.fromkeys(REQUEST_KINDS, 0)
        self.last_arrival = dict.fromkeys(REQUEST_KINDS, 0.0)
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("GET", "/kv_event_sources"): self._kv_event_sources,
        }
        if cfg.dev_mode:
            self.routes[("POST", "/reset_prefix_cache")] = self._reset_prefix_cache
        if self.embedding:
            self.routes[("POST", "/v1/embeddings")] = self._embeddings
        else:
            self.routes[("POST", "/v1/chat/completions")] = self._chat
            self.routes[("POST", "/v1/completions")] = self._completions
        if cfg.runtime_lora:
            self.routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            self.routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora
        self._paths = {p for _, p in self.routes}

    # -- time ------------------------------------------------------------------------------------

    def model_now(self) -> float:
        """Model seconds since start (wall seconds times the time scale)."""
        return (time.perf_counter() - self._t0) * self.config.time_scale

    def _wall_at(self, model_t: float) -> float:
        return self._t0 + model_t / self.config.time_scale

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        handler = self.routes.get((method, path))
        status, size_in, size_out = 500, 0, 0
        try:
            if handler is None:
                if path in self._paths:
                    allow = ", ".join(sorted(m for m, p in self.routes if p == path))
                    status, size_out = await _respond(
                        send, 405, b'{"detail":"Method Not Allowed"}', [*_JSON, (b"allow", allow.encode())]
                    )
                else:
                    status, size_out = await _respond(send, 404, b'{"detail":"Not Found"}', _JSON)
                return
            if self.config.api_key and path.startswith(("/v1", "/v2", "/inference")):
                got = headers.get("authorization", "")
                if not secrets.compare_digest(got.encode(), f"Bearer {self.config.api_key}".encode()):
                    status, size_out = await _respond(send, 401, b'{"error":"Unauthorized"}', _JSON)
                    return
            body = b""
            if method == "POST":
                body = await self._read_body(receive, headers)
                size_in = len(body)
            status, size_out = await handler(_Call(scope, body, headers, receive, send))
        except HTTPError as err:
            status, size_out = await _respond(send, err.status, err.body(), _JSON)
        finally:
            handler_name = path if path in self._paths else "none"
            seconds = time.perf_counter() - t0
            self.http_metrics.observe(handler_name, method, status, size_in, size_out, seconds)
            if method == "POST" and ACCESS.isEnabledFor(logging.INFO):
                ACCESS.info(
                    "request",
                    extra={
                        # The id the engine ran the request under (vLLM takes X-Request-Id so).
                        "request_id": headers.get("x-request-id"),
                        "method": method,
                        "path": path,
                        "status": status,
                        "duration_ms": round(seconds * 1000, 2),
                    },
                )

    async def _read_body(self, receive: Receive, headers: Mapping[str, str]) -> bytes:
        limit = self.config.max_request_bytes
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body larger than {limit} bytes", "RequestEntityTooLarge")
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise HTTPError(413, f"request body larger than {limit} bytes", "RequestEntityTooLarge")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return b"".join(chunks)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def start(self) -> None:
        """Start the engine task on the running loop (uvicorn's lifespan calls this), and the KV
        event publisher when configured."""
        kv = self.config.kv_events
        if (
            self.publisher is None
            and kv is not None
            and kv.enabled
            and self.engine.block_pool.kv_event_queue is not None
        ):
            self.publisher = KVEventPublisher.from_config(kv)
            publisher = self.publisher
            self.engine.on_kv_events = publisher.publish
            log.info(
                "tidal sim: KV events on %s (replay %s)",
                self.publisher.endpoint,
                self.publisher.replay_endpoint,
            )
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self.publisher is not None:
            self.engine.on_kv_events = None
            self.publisher.close()
            self.publisher = None

    # -- the engine task -------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        engine = self.engine
        assert self._wake is not None
        wake = self._wake
        nominal: float | None = None  # when the next step begins, in model time
        prev_end: float | None = None  # when the previous step really ended (back to back)
        try:
            while True:
                if not engine.has_work():
                    wake.clear()
                    nominal = prev_end = None
                    await wake.wait()
                    continue
                now = self.model_now()
                begin = now if nominal is None or nominal > now else nominal
                # Far behind (a stalled process): restart the timeline rather than burst to catch up.
                if now - begin > 1.0 * self.config.time_scale:
                    begin = now
                step = engine.begin_step(begin)
                if step is None:
                    nominal = prev_end = None
                    continue
                end = begin + step.duration
                delay = self._wall_at(end) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)  # let handlers run even when behind
                actual_end = self.model_now()
                self.steps += 1
                self.model_step_seconds += step.duration
                # The step really took from the previous step's end (or from now, after idling).
                self.wall_step_seconds += actual_end - (prev_end if prev_end is not None else now)
                self.lateness_seconds += max(0.0, actual_end - end)
                self._deliver(engine.end_step(step, end), step)
                nominal = end
                prev_end = actual_end
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # pragma: no cover - a bug in the engine
            log.exception("simulated engine failed")
            self._dead = exc
            for r in list(engine.scheduler.requests.values()):
                group = r.user_data
                if isinstance(group, _Stream):
                    group.done = True
                    group.finish_reason = "error"
                    group.wake()

    def _deliver(self, result: tuple[list[Request], list[Request]], step: StepOutput) -> None:
        produced, finished = result
        for r in produced:
            s = r.user_data
            if isinstance(s, _Stream):
                if r.output_token_ids:
                    s.items.append(r.output_token_ids[-1])
                s.wake()
        for r in finished:
            s = r.user_data
            if isinstance(s, _Stream):
                s.done = True
                s.finish_reason = RequestStatus.get_finished_reason(r.status)
                s.wake()

    def _next_token(self, r: Request) -> int:
        s = r.user_data
        i = r.num_output_tokens
        if isinstance(s, _Stream) and s.forced is not None and i < len(s.forced):
            return s.forced[i]
        if r.stop_after is not None and i == r.stop_after - 1 and r.stop_after < r.max_tokens:
            return self.tokenizer.eos_token_id  # the simulated model ends its answer
        key = r.block_hashes[0] if r.block_hashes else hash(tuple(r.prompt_token_ids or ()))
        return self.text_model.next_token(key, self.config.seed, i)

    # -- admission -------------------------------------------------------------------------------

    def _resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a model name means (None: the base model); 404 when unknown."""
        if not name or name in self.served_names:
            return None
        if name in self.engine.loras:
            return name
        raise HTTPError(
            404,
            f"The model `{name}` does not exist. Valid aliases: {', '.join(self.served_names)}.",
            "NotFoundError",
            "model",
        )

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise HTTPError(500, "The simulated engine is dead.", "InternalServerError")

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        mml = self.max_model_len
        if requested is not None:
            if requested < 1:
                raise _bad_request(
                    f"max_tokens must be at least 1, got {requested}.", "max_tokens", requested
                )
            if requested > mml:
                raise _bad_request(
                    f"max_tokens={requested} cannot be greater than max_model_len={mml}. "
                    "Please request fewer output tokens.",
                    "max_tokens",
                    requested,
                )
        if prompt_len > mml:
            raise _bad_request(
                f"This model's maximum context length is {mml} tokens. However, your prompt contains at "
                f"least {mml + 1} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                "input_tokens",
                mml + 1,
            )
        limit = mml - prompt_len
        return limit if requested is None else min(requested, limit)

    def _admit(self) -> None:
        engine = self.engine
        if engine.num_waiting >= self.config.max_num_queued_reqs:
            rej = engine.admission_rejections
            rej["max_num_queued_reqs"] = rej.get("max_num_queued_reqs", 0) + 1
            raise HTTPError(
                503,
                "The engine is currently busy and cannot accept new requests. Please try again later "
                "or on a different instance.",
                "Service Unavailable",
            )
        if self.config.error_rate > 0 and self._rng.random() < self.config.error_rate:
            raise HTTPError(500, "Simulated engine failure (--error-rate).", "InternalServerError")

    def _request_id(self, headers: Mapping[str, str], body: _Body, prefix: str) -> str:
        rid = headers.get("x-request-id") or body.request_id or secrets.token_hex(8)
        if len(rid) > 256:
            raise _bad_request("request_id is longer than 256 characters.", "request_id")
        kind = _kind(rid)
        self.arrivals[kind] += 1
        self.last_arrival[kind] = time.time()
        return f"{prefix}-{rid}"

    def _start(
        self,
        base_id: str,
        prompt_ids: list[int],
        body: _Body,
        lora: str | None,
        n: int,
        forced: list[int] | None,
        max_tokens: int,
        explicit_max: bool,
    ) -> _Group:
        """Submit the request's ``n`` choices to the engine.

        The simulated model ends an answer by itself (finish reason ``stop``) when it has an
        answer-key answer, or -- unless ``ignore_eos`` -- after its natural length when the
        request set no ``max_tokens`` (or always, with ``natural_stop_always``).
        """
        engine = self.engine
        group = _Group(n)
        seed = body.seed if body.seed is not None else self.config.seed
        prompt_key = hash(tuple(prompt_ids[:4096]))
        now = self.model_now()
        rids = [base_id] if n == 1 else [f"{base_id}_{i}" for i in range(n)]
        for rid in rids:
            if rid in engine.scheduler.requests:
                raise _bad_request(f"request id {rid!r} is already in flight.", "request_id")
        natural = not body.ignore_eos and (not explicit_max or self.config.natural_stop_always)
        for i, (s, rid) in enumerate(zip(group.streams, rids, strict=True)):
            stop_after: int | None = None
            if forced is not None:
                stop_after = len(forced) + 1  # the answer, then the end-of-turn token
            elif natural:
                stop_after = self.text_model.natural_length(prompt_key, seed + i)
            if stop_after is not None and body.min_tokens:
                stop_after = max(stop_after, body.min_tokens)
            r = engine.make_request(
                rid,
                prompt_token_ids=prompt_ids,
                max_tokens=max_tokens,
                priority=body.priority,
                lora=lora,
                stop_after=stop_after,
            )
            s.request = r
            r.user_data = s
            if forced is not None:
                s.forced = [*forced, self.tokenizer.eos_token_id]
            engine.add_request(r, now)
        assert self._wake is not None, "the engine task is not running"
        self._wake.set()
        return group

    def _abort(self, group: _Group) -> None:
        for s in group.streams:
            r = s.request
            if r is not None and not r.is_finished:
                self.engine.abort_request(r.request_id)
            if not s.done:
                s.done = True
                s.finish_reason = "abort"
                s.wake()

    # -- handlers --------------------------------------------------------------------------------

    async def _health(self, call: _Call) -> tuple[int, int]:
        if self._dead is not None:
            return await _respond(call.send, 503, b"", [])
        return await _respond(call.send, 200, b"", [])

    async def _kv_event_sources(self, call: _Call) -> tuple[int, int]:
        # vLLM: the publisher config per data-parallel rank; {} when there is none.
        out: dict[str, Any] = {}
        kv, pub = self.config.kv_events, self.publisher
        if kv is not None and pub is not None:
            cfg = json.loads(kv.to_json())
            cfg["publisher"] = "zmq"
            if kv.endpoint.endswith(":0"):
                cfg["endpoint"] = pub.endpoint  # an ephemeral port, as bound
            if kv.replay_endpoint is not None and kv.replay_endpoint.endswith(":0"):
                cfg["replay_endpoint"] = pub.replay_endpoint
            out["0"] = cfg
        return await _respond(call.send, 200, json.dumps(out).encode(), _JSON)

    async def _reset_prefix_cache(self, call: _Call) -> tuple[int, int]:
        ok = self.engine.reset_prefix_cache()
        return await _respond(call.send, 200, json.dumps({"success": ok}).encode(), _JSON)

    async def _version(self, call: _Call) -> tuple[int, int]:
        return await _respond(call.send, 200, json.dumps({"version": SIM_VERSION}).encode(), _JSON)

    async def _metrics(self, call: _Call) -> tuple[int, int]:
        return await _respond(
            call.send,
            200,
            generate_latest(self.metrics_registry),
            [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        )

    async def _models(self, call: _Call) -> tuple[int, int]:
        now = int(time.time())
        root = self.config.root or self.engine.preset.model.name

        def card(id_: str, root_: str, parent: str | None, mml: int | None) -> dict[str, Any]:
            return {
                "id": id_,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": root_,
                "parent": parent,
                "max_model_len": mml,
                "permission": [
                    {
                        "id": f"modelperm-{secrets.token_hex(8)}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        data = [card(n, root, None, self.max_model_len) for n in self.served_names]
        data += [card(a.name, a.path, self.served_names[0], None) for a in self.engine.loras.values()]
        return await _respond(
            call.send,
            200,
            json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode(),
            _JSON,
        )

    def _parse(self, body: bytes, headers: Mapping[str, str], model: type[BaseModel]) -> Any:
        ctype = headers.get("content-type", "")
        if not ctype.split(";")[0].strip().lower() == "application/json":
            raise HTTPError(
                400,
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
            )
        try:
            raw = json.loads(body) if body else None
        except json.JSONDecodeError as exc:
            raise _json_error(exc) from None
        except UnicodeDecodeError:
            raise HTTPError(400, "1 validation error:\n  body is not UTF-8", "Bad Request") from None
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def _tokenize(self, call: _Call) -> tuple[int, int]:
        req: _TokenizeBody = self._parse(call.body, call.headers, _TokenizeBody)
        self._resolve_model(req.model)
        if req.messages is not None:
            text = self.tokenizer.render_chat([_message_dict(m) for m in req.messages])
        elif req.prompt is not None:
            text = req.prompt
        else:
            raise _bad_request("Either `prompt` or `messages` must be given.", "prompt")
        ids = self.tokenizer.encode(text) if req.messages is not None else self.tokenizer.encode_prompt(text)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        return await _respond(call.send, 200, json.dumps(out, separators=(",", ":")).encode(), _JSON)

    async def _detokenize(self, call: _Call) -> tuple[int, int]:
        req: _DetokenizeBody = self._parse(call.body, call.headers, _DetokenizeBody)
        self._resolve_model(req.model)
        text = self.tokenizer.decode(req.tokens[: self.max_model_len])
        return await _respond(call.send, 200, json.dumps({"prompt": text}).encode(), _JSON)

    async def _load_lora(self, call: _Call) -> tuple[int, int]:
        req: _LoadLoRABody = self._parse(call.body, call.headers, _LoadLoRABody)
        name = req.lora_name
        if not name or not req.lora_path:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.served_names:
            raise HTTPError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if name in self.engine.loras:
            if not req.load_inplace:
                raise HTTPError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            self.engine.unload_lora(name)
        if self.engine.config.max_loras <= 0:
            raise HTTPError(400, "LoRA is not enabled on this replica (--max-loras 0).", "InvalidUserInput")
        if len(self.engine.loras) >= 1024:
            raise HTTPError(400, "Too many LoRA adapters loaded (1024).", "InvalidUserInput")
        # NOTE: the path is recorded, never read: no request may make the simulator touch files.
        self.engine.load_lora(name, req.lora_path)
        msg = f"Success: LoRA adapter '{name}' added successfully."
        return await _respond(call.send, 200, msg.encode(), [])

    async def _unload_lora(self, call: _Call) -> tuple[int, int]:
        req: _UnloadLoRABody = self._parse(call.body, call.headers, _UnloadLoRABody)
        if req.lora_name not in self.engine.loras:
            raise HTTPError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError")
        self.engine.unload_lora(req.lora_name)
        msg = f"Success: LoRA adapter '{req.lora_name}' removed successfully."
        return await _respond(call.send, 200, msg.encode(), [])

    def _common_checks(self, req: _Body) -> int:
        self._check_alive()
        if req.stream_options is not None and not req.stream:
            raise _bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        if req.stream_options is not None:
            try:
                _StreamOptions.model_validate(req.stream_options)
            except ValidationError as exc:
                raise _validation_error(exc) from None
        n = 1 if req.n is None else req.n
        if n < 1:
            raise _bad_request(f"n must be at least 1, got {n}.", "n", n)
        if n > self.config.max_n:
            raise _bad_request(f"n must be at most {self.config.max_n} on this replica, got {n}.", "n", n)
        return n

    async def _chat(self, call: _Call) -> tuple[int, int]:
        req: _ChatBody = self._parse(call.body, call.headers, _ChatBody)
        n = self._common_checks(req)
        lora = self._resolve_model(req.model)
        messages = [_message_dict(m) for m in req.messages]
        prompt = self.tokenizer.render_chat(messages)
        prompt_ids = self.tokenizer.encode(prompt)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids))
        last_user = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), None)
        forced = self.text_model.answer(last_user, req.seed if req.seed is not None else self.config.seed)
        self._admit()
        rid = self._request_id(call.headers, req, "chatcmpl")
        group = self._start(rid, prompt_ids, req, lora, n, forced, max_tokens, requested is not None)
        model = req.model or self.served_names[0]
        return await self._run(group, rid, model, len(prompt_ids), req, call.receive, call.send, chat=True)

    async def _completions(self, call: _Call) -> tuple[int, int]:
        req: _CompletionBody = self._parse(call.body, call.headers, _CompletionBody)
        n = self._common_checks(req)
        lora = self._resolve_model(req.model)
        prompts = _prompt_list(req.prompt)
        if len(prompts) != 1:
            raise _bad_request("The simulated replica takes one prompt per request.", "prompt")
        p = prompts[0]
        key_prompt: str | None = None
        if isinstance(p, str):
            prompt_ids = self.tokenizer.encode_prompt(p)  # with the tokenizer's BOS, as vLLM
            key_prompt = p
        else:
            prompt_ids = p
        if not prompt_ids:
            raise _bad_request("Prompt cannot be empty.", "prompt")
        if req.echo:
            raise _bad_request("echo is not supported by the simulated replica.", "echo")
        max_tokens = self._max_tokens(req.max_tokens, len(prompt_ids))
        forced = self.text_model.answer(key_prompt, req.seed if req.seed is not None else self.config.seed)
        self._admit()
        rid = self._request_id(call.headers, req, "cmpl")
        explicit = "max_tokens" in req.model_fields_set
        group = self._start(rid, prompt_ids, req, lora, n, forced, max_tokens, explicit)
        model = req.model or self.served_names[0]
        return await self._run(group, rid, model, len(prompt_ids), req, call.receive, call.send, chat=False)

    async def _embeddings(self, call: _Call) -> tuple[int, int]:
        req: _EmbeddingBody = self._parse(call.body, call.headers, _EmbeddingBody)
        self._check_alive()
        self._resolve_model(req.model)
        inputs = [self.tokenizer.encode(x) if isinstance(x, str) else x for x in _prompt_list(req.input)]
        if not inputs or len(inputs) > 2048:
            raise _bad_request("input must hold between 1 and 2048 items.", "input")
        dim = self.engine.preset.model.hidden_size
        if req.dimensions is not None and req.dimensions != dim:
            raise _bad_request(
                f"Model does not support matryoshka representation, dimensions must be {dim}.", "dimensions"
            )
        for ids in inputs:
            if not ids:
                raise _bad_request("Input cannot be empty.", "input")
            self._max_tokens(None, len(ids))
        self._admit()
        base = f"embd-{call.headers.get('x-request-id') or secrets.token_hex(8)}"
        engine = self.engine
        group = _Group(len(inputs))
        now = self.model_now()
        for i, (s, ids) in enumerate(zip(group.streams, inputs, strict=True)):
            r = engine.make_request(f"{base}_{i}", prompt_token_ids=ids, max_tokens=1, priority=req.priority)
            s.request = r
            r.user_data = s
            engine.add_request(r, now)
        assert self._wake is not None
        self._wake.set()
        disconnected = _watch_disconnect(call.receive, lambda: self._abort(group))
        try:
            while not all(s.done for s in group.streams):
                await group.wait()
        finally:
            disconnected.cancel()
        data = [
            {"index": i, "object": "embedding", "embedding": _embedding(ids, dim, self.config.seed)}
            for i, ids in enumerate(inputs)
        ]
        total = sum(len(x) for x in inputs)
        out = {
            "id": base,
            "object": "list",
            "created": int(time.time()),
            "model": req.model or self.served_names[0],
            "data": data,
            "usage": {
                "prompt_tokens": total,
                "total_tokens": total,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        return await _respond(call.send, 200, json.dumps(out, separators=(",", ":")).encode(), _JSON)

    # -- generation responses ------------------------------------------------------------------

    def _text_json(self, token_id: int) -> str:
        t = self._text_cache.get(token_id)
        if t is None:
            t = json.dumps(self.tokenizer.token_text(token_id))
            if len(self._text_cache) < 1_000_000:
                self._text_cache[token_id] = t
        return t

    async def _run(
        self,
        group: _Group,
        rid: str,
        model: str,
        prompt_len: int,
        req: _Body,
        receive: Receive,
        send: Send,
        *,
        chat: bool,
    ) -> tuple[int, int]:
        disconnected = _watch_disconnect(receive, lambda: self._abort(group))
        try:
            if req.stream:
                return await self._stream(group, rid, model, prompt_len, req, send, chat=chat)
            while not all(s.done for s in group.streams):
                await group.wait()
            return await self._full(group, rid, model, prompt_len, send, chat=chat)
        finally:
            disconnected.cancel()
            self._abort(group)  # no-op unless the handler ended early

    async def _full(
        self, group: _Group, rid: str, model: str, prompt_len: int, send: Send, *, chat: bool
    ) -> tuple[int, int]:
        choices = []
        completion = 0
        for s in group.streams:
            if s.finish_reason == "error":
                raise HTTPError(500, "The simulated engine failed.", "InternalServerError")
            r = s.request
            assert r is not None and r.output_token_ids is not None
            ids = r.output_token_ids
            completion += len(ids)
            text = "".join(self.tokenizer.token_text(t) for t in ids)
            if chat:
                choices.append(
                    {
                        "index": s.choice,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": s.choice,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": s.finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
        usage = {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": usage,
        }
        if chat:
            out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return await _respond(send, 200, json.dumps(out, separators=(",", ":")).encode(), _JSON)

    async def _stream(
        self, group: _Group, rid: str, model: str, prompt_len: int, req: _Body, send: Send, *, chat: bool
    ) -> tuple[int, int]:
        opts = req.stream_options or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},"model":{json.dumps(model)},'
            '"choices":[{"index":'
        )
        text_key = '"delta":{"content":' if chat else '"text":'
        tail_mid = (
            '},"logprobs":null,"finish_reason":null,"token_ids":null}]'
            if chat
            else ',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
        )
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        sent = 0
        if chat:
            # The first chunk of each choice: the role, with empty content.
            first = "".join(
                f'{head}{s.choice},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                '"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
                for s in group.streams
            ).encode()
            await send({"type": "http.response.body", "body": first, "more_body": True})
            sent += len(first)
        counts = [0] * len(group.streams)
        finished = [False] * len(group.streams)
        text_cache = self._text_cache
        while not all(finished):
            await group.wait()
            parts: list[str] = []
            for s in group.streams:
                i = s.choice
                if finished[i]:
                    continue
                if s.finish_reason == "error":
                    err = HTTPError(500, "The simulated engine failed.", "InternalServerError")
                    parts.append(f"data: {err.body().decode()}\n\n")
                    finished[:] = [True] * len(finished)
                    break
                while s.items:
                    tok = s.items.popleft()
                    counts[i] += 1
                    last = s.done and not s.items
                    piece = text_cache.get(tok) or self._text_json(tok)
                    usage = ""
                    if continuous:
                        u = sum(counts)
                        usage = f',"usage":{{"prompt_tokens":{prompt_len},"total_tokens":{prompt_len + u},"completion_tokens":{u}}}'
                    if last:
                        fp = "" if include_usage else f',"system_fingerprint":"{self.fingerprint}"'
                        reason = json.dumps(s.finish_reason)
                        if chat:
                            parts.append(
                                f'{head}{i},{text_key}{piece}}},"logprobs":null,"finish_reason":{reason},'
                                f'"stop_reason":null,"token_ids":null}}]{usage}{fp}}}\n\n'
                            )
                        else:
                            parts.append(
                                f'{head}{i},{text_key}{piece},"logprobs":null,"finish_reason":{reason},'
                                f'"stop_reason":null,"prompt_token_ids":null,"token_ids":null}}]{usage}{fp}}}\n\n'
                            )
                    else:
                        parts.append(f"{head}{i},{text_key}{piece}{tail_mid}{usage}}}\n\n")
                if s.done and not s.items:
                    finished[i] = True
            if parts:
                chunk = "".join(parts).encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
        tail = ""
        if include_usage:
            total = sum(counts)
            tail = (
                f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},"model":{json.dumps(model)},'
                f'"choices":[],"usage":{{"prompt_tokens":{prompt_len},"total_tokens":{prompt_len + total},'
                f'"completion_tokens":{total}}},"system_fingerprint":"{self.fingerprint}"}}\n\n'
            )
        end = (tail + "data: [DONE]\n\n").encode()
        await send({"type": "http.response.body", "body": end, "more_body": False})
        return 200, sent + len(end)


def _kind(request_id: str) -> str:
    """``batch`` for the batch tier's lines (request id ``batch-...``, maybe behind a
    ``cmpl-``/``chatcmpl-`` prefix), else ``interactive``."""
    bare = request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
    return "batch" if bare.startswith("batch-") else "interactive"


def _prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as a list."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [[int(x) for x in value if isinstance(x, int)]]
    out: list[str | list[int]] = []
    for x in value:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list):
            out.append([int(t) for t in x])
    return out


def _message_dict(m: _Message) -> dict[str, Any]:
    try:
        return flatten_messages([{"role": m.role, "content": m.content}])[0]
    except ValueError as exc:
        raise _bad_request(str(exc), "messages") from None


def _embedding(ids: list[int], dim: int, seed: int) -> list[float]:
    # A deterministic unit vector per input; equal inputs give equal embeddings.
    rng = random.Random(stable_hash("embedding", seed, tuple(ids[:8192])))
    v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task[None]:
    """A task that calls ``on_disconnect`` when the client goes away (cancel it when done)."""

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.get_running_loop().create_task(watch())


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, int]:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return status, len(body)


def serve(
    config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn, uvloop, httptools)."""
    import uvicorn

    app = SimServer(config)
    log.info(
        "tidal sim: preset %s as %s on http://%s:%d (%d KV blocks of %d tokens, time scale %g)",
        config.preset,
        ",".join(app.served_names),
        host,
        port,
        app.engine.config.num_gpu_blocks,
        app.engine.block_size,
        config.time_scale,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        log_config=uvicorn_log_config(),
        access_log=False,
        timeout_keep_alive=30,
        limit_concurrency=max(1024, config.max_num_queued_reqs * 2),
    )
