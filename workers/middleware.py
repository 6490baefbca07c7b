"""Cross-cutting concerns of chunk execution, as middleware (Dramatiq's shape).

Every hook is a documented no-op; a middleware overrides the ones it needs. ``before_*`` hooks run
in list order, ``after_*`` hooks in reverse order, and a middleware that raises is logged and
skipped (it never takes a chunk down with it).

=====================  ===============================================================
middleware             does
=====================  ===============================================================
``PriorityMapping``    low vLLM ``priority`` and a ``batch-<batch>-<custom_id>`` request id
``Retries``            retry-safe replica errors go to another replica with backoff
``TimeLimit``          stop sending after ``limit_s`` so a chunk stays under consumer_timeout
``LanePause``          pause on the lane's control message: abort in-flight lines, requeue
``Preemption``         SIGTERM (spot notice): stop sending, finish in-flight within the window
``BatchClosed``        the batch was cancelled or expired: stop, keep what is done
``Metrics``            ``tidal_worker_*`` Prometheus series per lane
``AccessLog``          one ``tidal.access`` line per attempt, named by its request id
=====================  ===============================================================

Example::

    class Audit(ChunkMiddleware):
        def after_request(self, ctx, req, attempt):
            log.info("%s %s -> %s", ctx.batch_id, req.custom_id, attempt.status)
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tidal.logs import ACCESS
from tidal.priority.classes import vllm_priority
from tidal.replicas.errors import ReplicaError

if TYPE_CHECKING:
    from tidal.workers.chunk import ChunkContext, ChunkOutcome

__all__ = [
    "AccessLog",
    "Attempt",
    "BatchClosed",
    "ChunkMiddleware",
    "LanePause",
    "Metrics",
    "OutgoingRequest",
    "Preemption",
    "PriorityMapping",
    "Retries",
    "TimeLimit",
    "emit_after",
    "emit_before",
]

log = logging.getLogger(__name__)


@dataclass
class OutgoingRequest:
    """One line on its way to a replica; middleware may change the body and headers."""

    line_no: int
    custom_id: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    attempt: int = 0
    retry_in: float | None = None  # set by Retries.after_request
    avoid: set[str] = field(default_factory=set)  # replicas that failed this line


@dataclass
class Attempt:
    """The outcome of one attempt: an HTTP answer, or an error before any answer."""

    replica: str
    status: int | None = None
    body: str | None = None
    error: ReplicaError | None = None
    seconds: float = 0.0
    aborted: bool = False  # cancelled before an answer (pause, preemption, closed batch)


class ChunkMiddleware:
    """Base class: every hook does nothing."""

    def before_chunk(self, ctx: ChunkContext) -> None:
        """Before the first line is sent."""

    def after_chunk(self, ctx: ChunkContext, outcome: ChunkOutcome) -> None:
        """After the chunk ended: done, released (requeued), closed or dead."""

    def before_request(self, ctx: ChunkContext, req: OutgoingRequest) -> None:
        """Before each attempt of a line."""

    def after_request(self, ctx: ChunkContext, req: OutgoingRequest, attempt: Attempt) -> None:
        """After each attempt; set ``req.retry_in`` to try again."""


def emit_before(middleware: list[ChunkMiddleware], hook: str, *args: Any) -> None:
    for m in middleware:
        try:
            getattr(m, "before_" + hook)(*args)
        except Exception:
            log.exception("middleware %s.before_%s failed", type(m).__name__, hook)


def emit_after(middleware: list[ChunkMiddleware], hook: str, *args: Any) -> None:
    for m in reversed(middleware):
        try:
            getattr(m, "after_" + hook)(*args)
        except Exception:
            log.exception("middleware %s.after_%s failed", type(m).__name__, hook)


_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]")


class PriorityMapping(ChunkMiddleware):
    """Batch priority 0..9 (9 most urgent) to vLLM's ``priority`` (smaller sooner), always below
    interactive classes; and a recognisable ``X-Request-Id``: ``batch-<batch>-<custom_id>``."""

    def before_request(self, ctx: ChunkContext, req: OutgoingRequest) -> None:
        if ctx.endpoint != "/v1/embeddings":
            req.body["priority"] = vllm_priority(ctx.priority)
        safe = _SAFE_ID.sub("_", req.custom_id)[:64]
        req.headers["X-Request-Id"] = f"batch-{ctx.batch_id}-{safe}"


class AccessLog(ChunkMiddleware):
    """With the access log on (:mod:`tidal.logs`), one line per attempt at a batch line, under the
    request id the replica got: a line is followed from gateway to worker to replica by that id."""

    def after_request(self, ctx: ChunkContext, req: OutgoingRequest, attempt: Attempt) -> None:
        if not ACCESS.isEnabledFor(logging.INFO):
            return
        ACCESS.info(
            "batch line",
            extra={
                "request_id": req.headers.get("X-Request-Id"),
                "batch_id": ctx.batch_id,
                "custom_id": req.custom_id,
                "line": req.line_no,
                "path": ctx.endpoint,
                "replica": attempt.replica,
                "attempt": req.attempt,
                "status": attempt.status,
                "error": str(attempt.error) if attempt.error is not None else None,
                "aborted": attempt.aborted or None,
                "duration_ms": round(attempt.seconds * 1000, 2),
            },
        )


class Retries(ChunkMiddleware):
    """Retry-safe errors (connection refused, 429/5xx, timeouts) go to another replica after an
    exponential backoff with jitter; other errors are final and land in the error file."""

    def __init__(
        self,
        max_attempts: int = 4,
        min_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        seed: int | None = None,
    ) -> None:
        self.max_attempts = max_attempts
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._rng = random.Random(seed)

    def after_request(self, ctx: ChunkContext, req: OutgoingRequest, attempt: Attempt) -> None:
        if attempt.error is None or not attempt.error.retry_safe:
            return
        if req.attempt + 1 >= self.max_attempts:
            return
        req.avoid.add(attempt.replica)
        backoff = min(self.max_backoff_s, self.min_backoff_s * 2**req.attempt)
        req.retry_in = backoff * (0.5 + self._rng.random() / 2)


class TimeLimit(ChunkMiddleware):
    """Stop sending new lines after ``limit_s`` (the rest is requeued): a chunk never comes near
    RabbitMQ's ``consumer_timeout``, and preemption redoes little."""

    def __init__(self, limit_s: float, grace_s: float = 30.0) -> None:
        self.limit_s = limit_s
        self.grace_s = grace_s

    def before_chunk(self, ctx: ChunkContext) -> None:
        ctx.call_later(self.limit_s, lambda: ctx.stop("time_limit", grace_s=self.grace_s))


class LaneGate:
    """In-process view of which lanes are paused, fed by the control fanout and the persisted
    lane state; running chunks of a lane that pauses are told to stop at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paused: dict[str, bool] = {}
        self._running: set[ChunkContext] = set()
        self.listeners: list[Callable[[str, bool], None]] = []

    def paused(self, lane: str) -> bool:
        return self._paused.get(lane, False)

    def snapshot(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._paused)

    def apply(self, lane: str, paused: bool, reason: str = "") -> bool:
        """Record the state; returns True when it changed."""
        with self._lock:
            changed = self._paused.get(lane, False) != paused
            self._paused[lane] = paused
            running = [c for c in self._running if c.lane == lane]
        if paused:
            for ctx in running:
                ctx.stop_threadsafe("paused", abort=True)
        if changed:
            log.info(
                "lane %s %s%s", lane, "paused" if paused else "resumed", f" ({reason})" if reason else ""
            )
            for listener in self.listeners:
                listener(lane, paused)
        return changed

    def enter(self, ctx: ChunkContext) -> None:
        with self._lock:
            self._running.add(ctx)

    def leave(self, ctx: ChunkContext) -> None:
        with self._lock:
            self._running.discard(ctx)


class LanePause(ChunkMiddleware):
    """Pause on interactive load: a chunk of a paused lane does not start; a running one aborts
    its outstanding requests (the replica frees their KV blocks), keeps finished results and
    requeues the rest."""

    def __init__(self, gate: LaneGate) -> None:
        self.gate = gate

    def before_chunk(self, ctx: ChunkContext) -> None:
        self.gate.enter(ctx)
        if self.gate.paused(ctx.lane):
            ctx.stop("paused", abort=True)

    def after_chunk(self, ctx: ChunkContext, outcome: ChunkOutcome) -> None:
        self.gate.leave(ctx)


class Preemption(ChunkMiddleware):
    """SIGTERM (a spot notice): stop sending, give in-flight lines ``grace_s`` to finish, abort
    the rest, save what finished and requeue the remainder -- all inside the soft-shutdown
    window."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._running: set[ChunkContext] = set()
        self.preempted = threading.Event()

    def preempt(self) -> None:
        self.preempted.set()
        with self._lock:
            running = list(self._running)
        for ctx in running:
            ctx.stop_threadsafe("preempted", grace_s=self.grace_s)

    def before_chunk(self, ctx: ChunkContext) -> None:
        with self._lock:
            self._running.add(ctx)
        if self.preempted.is_set():
            ctx.stop("preempted", abort=True)

    def after_chunk(self, ctx: ChunkContext, outcome: ChunkOutcome) -> None:
        with self._lock:
            self._running.discard(ctx)


class BatchClosed(ChunkMiddleware):
    """Watch the batch while the chunk runs: once it is cancelled, expired or being finalised,
    stop sending (what finished is kept; the finaliser accounts for the rest)."""

    def __init__(self, is_open: Callable[[str], bool], interval_s: float = 1.0) -> None:
        self.is_open = is_open
        self.interval_s = interval_s

    def before_chunk(self, ctx: ChunkContext) -> None:
        async def watch() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                if not await asyncio.to_thread(self.is_open, ctx.batch_id):
                    ctx.stop("batch_closed", abort=True, requeue=False)
                    return

        ctx.spawn(watch())


class Metrics(ChunkMiddleware):
    """``tidal_worker_chunks_total{lane,outcome}``, ``tidal_worker_lines_total{lane,result}``,
    ``tidal_worker_chunk_duration_seconds{lane}``, ``tidal_worker_inflight_lines{lane}``,
    ``tidal_worker_retries_total{lane}``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.chunks = Counter(
            "tidal_worker_chunks_total",
            "Chunks ended, by outcome",
            ["lane", "outcome"],
            registry=self.registry,
        )
        self.lines = Counter(
            "tidal_worker_lines_total", "Line attempts, by result", ["lane", "result"], registry=self.registry
        )
        self.retries = Counter("tidal_worker_retries_total", "Line retries", ["lane"], registry=self.registry)
        self.duration = Histogram(
            "tidal_worker_chunk_duration_seconds",
            "Wall time of a chunk",
            ["lane"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "tidal_worker_inflight_lines", "Lines being sent now", ["lane"], registry=self.registry
        )

    def before_chunk(self, ctx: ChunkContext) -> None:
        ctx.started_at = time.monotonic()

    def after_chunk(self, ctx: ChunkContext, outcome: ChunkOutcome) -> None:
        self.chunks.labels(ctx.lane, outcome.kind).inc()
        self.duration.labels(ctx.lane).observe(time.monotonic() - ctx.started_at)

    def before_request(self, ctx: ChunkContext, req: OutgoingRequest) -> None:
        self.inflight.labels(ctx.lane).inc()

    def after_request(self, ctx: ChunkContext, req: OutgoingRequest, attempt: Attempt) -> None:
        self.inflight.labels(ctx.lane).dec()
        if attempt.aborted:
            result = "aborted"
        elif attempt.error is not None:
            result = "error"
        elif attempt.status is not None and attempt.status >= 400:
            result = f"http_{attempt.status}"
        else:
            result = "ok"
        self.lines.labels(ctx.lane, result).inc()
        if req.retry_in is not None:
            self.retries.labels(ctx.lane).inc()
