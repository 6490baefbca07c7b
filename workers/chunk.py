"""Executing one chunk: its pending lines go concurrently to the lane's replicas, up to each
replica's ``batch_concurrency_per_replica`` (shared by every chunk of this worker), and results
are recorded as they arrive.

A chunk ends in one of four ways (:class:`ChunkOutcome`):

* ``done`` -- every line has a result; the message is acknowledged;
* ``released`` -- paused, preempted or out of time: finished results are kept, the message is
  requeued, and the next delivery skips the lines already done;
* ``closed`` -- the batch was cancelled or expired meanwhile; acknowledged;
* ``dead`` -- past the delivery limit; its lines are failed with the reason (set by the task).

Example::

    executor = ChunkExecutor(replicas, middleware, record=lambda results: ...)
    outcome = await executor.run(ChunkWork(batch_id, 0, lane="reserved", priority=5,
                                           endpoint="/v1/chat/completions", lines=[...]))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal.batch_jobs.results import LineResult
from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaError, ReplicaUnavailable, error_from_status
from tidal.workers.middleware import Attempt, ChunkMiddleware, OutgoingRequest, emit_after, emit_before

__all__ = [
    "ChunkContext",
    "ChunkExecutor",
    "ChunkOutcome",
    "ChunkWork",
    "PendingLine",
    "ReplicaSet",
    "ReplicaSlot",
]

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.25
FLUSH_AT = 64


@dataclass(frozen=True)
class PendingLine:
    line_no: int
    custom_id: str
    body: str  # JSON text as stored


@dataclass(frozen=True)
class ChunkWork:
    batch_id: str
    chunk_no: int
    lane: str  # the lane whose replicas run it (and whose pause stops it)
    priority: int
    endpoint: str
    lines: Sequence[PendingLine]


@dataclass
class ChunkOutcome:
    kind: Literal["done", "released", "closed", "dead"]
    reason: str = ""
    recorded: int = 0
    remaining: int = 0


class ReplicaSlot:
    """One replica with its shared concurrency budget."""

    def __init__(self, name: str, client: ReplicaClient, limit: int) -> None:
        self.name = name
        self.client = client
        self.limit = limit
        self.inflight = 0
        self.down_until = 0.0

    @property
    def free(self) -> int:
        return self.limit - self.inflight


class ReplicaSet:
    """The replicas a lane sends to; lines take a slot on the least busy healthy one."""

    def __init__(self, slots: list[ReplicaSlot]) -> None:
        if not slots:
            raise ValueError("a replica set needs at least one replica")
        self.slots = slots
        self._changed: asyncio.Event | None = None

    @property
    def changed(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def try_acquire(self, avoid: set[str] | None = None) -> ReplicaSlot | None:
        """A slot now, or None when every replica is at its limit (or cooling down)."""
        now = time.monotonic()
        live = [s for s in self.slots if s.free > 0 and s.down_until <= now]
        preferred = [s for s in live if s.name not in (avoid or ())] or live
        if not preferred:
            return None
        slot = max(preferred, key=lambda s: s.free / s.limit)
        slot.inflight += 1
        return slot

    async def wait_changed(self, timeout: float = 0.25) -> None:
        """Until a slot is released (or ``timeout``, so cooling-down replicas come back)."""
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    def release(self, slot: ReplicaSlot, *, failed: bool = False) -> None:
        slot.inflight -= 1
        if failed:
            slot.down_until = time.monotonic() + 1.0  # let a failing replica breathe
        self.changed.set()

    def replace_slots(self, slots: list[ReplicaSlot]) -> list[ReplicaSlot]:
        """Change the membership (replicas registered or removed at run time); returns the slots
        dropped. Lines already on a dropped slot finish there; no new line takes it."""
        if not slots:
            raise ValueError("a replica set needs at least one replica")
        kept = {id(s) for s in slots}
        dropped = [s for s in self.slots if id(s) not in kept]
        self.slots = slots
        self.changed.set()
        return dropped

    async def aclose(self) -> None:
        for s in self.slots:
            await s.client.aclose()


class ChunkContext:
    """What middleware sees and may act on while a chunk runs (on the worker's event loop)."""

    def __init__(self, work: ChunkWork, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.batch_id = work.batch_id
        self.chunk_no = work.chunk_no
        self.lane = work.lane
        self.priority = work.priority
        self.endpoint = work.endpoint
        self.loop = loop
        self.stop_reason: str | None = None
        self.abort = False
        self.requeue = True
        self.grace_s = 0.0
        self.stopped = asyncio.Event()
        self.started_at = 0.0
        self._handles: list[asyncio.TimerHandle] = []
        self._tasks: list[asyncio.Task[Any]] = []

    def stop(self, reason: str, *, abort: bool = False, grace_s: float = 0.0, requeue: bool = True) -> None:
        """Stop sending new lines. ``abort`` cancels in-flight requests now; otherwise they get
        ``grace_s`` seconds. ``requeue=False`` means the rest of the chunk is not wanted."""
        if self.stop_reason is None or (not requeue and self.requeue):
            self.stop_reason = reason
            self.requeue = requeue
            self.grace_s = grace_s
        self.abort = self.abort or abort
        self.stopped.set()

    def stop_threadsafe(self, reason: str, **kw: Any) -> None:
        self.loop.call_soon_threadsafe(lambda: self.stop(reason, **kw))

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self._handles.append(self.loop.call_later(delay, fn))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(self.loop.create_task(coro))

    def _cleanup(self) -> None:
        for h in self._handles:
            h.cancel()
        for t in self._tasks:
            t.cancel()


Recorder = Callable[[list[LineResult]], Awaitable[int]]


@dataclass
class _Flusher:
    record: Recorder
    buffer: list[LineResult] = field(default_factory=list)
    recorded: int = 0
    added: int = 0
    last: float = field(default_factory=time.monotonic)

    async def add(self, result: LineResult) -> None:
        self.added += 1
        self.buffer.append(result)
        if len(self.buffer) >= FLUSH_AT or time.monotonic() - self.last >= FLUSH_EVERY_S:
            await self.flush()

    async def flush(self) -> None:
        if self.buffer:
            batch, self.buffer = self.buffer, []
            self.recorded += await self.record(batch)
        self.last = time.monotonic()


class ChunkExecutor:
    """Runs chunks on the worker's event loop with the given middleware."""

    def __init__(self, middleware: list[ChunkMiddleware], *, request_timeout_s: float = 600.0) -> None:
        self.middleware = middleware
        self.request_timeout_s = request_timeout_s

    async def run(self, work: ChunkWork, replicas: ReplicaSet, record: Recorder) -> ChunkOutcome:
        ctx = ChunkContext(work, asyncio.get_running_loop())
        flusher = _Flusher(record)
        emit_before(self.middleware, "chunk", ctx)
        pending = list(reversed(work.lines))  # pop() from the end keeps input order
        inflight: dict[asyncio.Task[None], PendingLine] = {}
        stop_wait = asyncio.ensure_future(ctx.stopped.wait())
        try:
            while True:
                while pending and ctx.stop_reason is None:
                    slot = replicas.try_acquire()
                    if slot is None:
                        break
                    line = pending.pop()
                    inflight[asyncio.ensure_future(self._line(ctx, line, slot, replicas, flusher))] = line
                if ctx.stop_reason is not None:
                    await self._wind_down(ctx, inflight)
                    break
                if not pending and not inflight:
                    break
                slot_wait = asyncio.ensure_future(replicas.wait_changed()) if pending else None
                waiters: set[asyncio.Future[Any]] = {*inflight, stop_wait}
                if slot_wait is not None:
                    waiters.add(slot_wait)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if slot_wait is not None:
                    slot_wait.cancel()
                self._collect(done, inflight)
            await flusher.flush()
        finally:
            stop_wait.cancel()
            ctx._cleanup()
            for t in inflight:
                t.cancel()
        remaining = len(work.lines) - flusher.added  # unanswered: the next delivery sends them
        if ctx.stop_reason is None:
            outcome = ChunkOutcome("done", recorded=flusher.recorded)
        elif not ctx.requeue:
            outcome = ChunkOutcome("closed", ctx.stop_reason, flusher.recorded, remaining)
        else:
            outcome = ChunkOutcome("released", ctx.stop_reason, flusher.recorded, remaining)
        emit_after(self.middleware, "chunk", ctx, outcome)
        return outcome

    @staticmethod
    def _collect(done: set[asyncio.Future[Any]], inflight: dict[asyncio.Task[None], PendingLine]) -> None:
        for t in done:
            if t in inflight:
                inflight.pop(t)
                if not t.cancelled():
                    t.result()  # a bug in a line task surfaces here

    async def _wind_down(self, ctx: ChunkContext, inflight: dict[asyncio.Task[None], PendingLine]) -> None:
        """In-flight lines finish within the grace period (none when aborting); the rest are
        cancelled, which closes their HTTP requests so the replica aborts them."""
        if inflight and not ctx.abort and ctx.grace_s > 0:
            done, _ = await asyncio.wait(set(inflight), timeout=ctx.grace_s)
            self._collect(set(done), inflight)
        for t in inflight:
            t.cancel()
        if inflight:
            done, _ = await asyncio.wait(set(inflight))
            for t in done:
                inflight.pop(t)

    async def _line(
        self, ctx: ChunkContext, line: PendingLine, slot: ReplicaSlot, replicas: ReplicaSet, flusher: _Flusher
    ) -> None:
        req = OutgoingRequest(line.line_no, line.custom_id, json.loads(line.body))
        current: ReplicaSlot | None = slot
        try:
            while True:
                assert current is not None
                req.retry_in = None
                emit_before(self.middleware, "request", ctx, req)
                attempt = Attempt(current.name)
                t0 = time.monotonic()
                try:
                    attempt.status, attempt.body = await self._send(current, ctx.endpoint, req)
                    if attempt.status >= 400:
                        attempt.error = error_from_status(
                            attempt.status, _json_or_none(attempt.body), attempt.body or "", current.name
                        )
                except ReplicaError as exc:
                    attempt.error = exc
                except asyncio.CancelledError:
                    emit_after(self.middleware, "request", ctx, req, Attempt(current.name, aborted=True))
                    raise
                attempt.seconds = time.monotonic() - t0
                failed_over = attempt.error is not None and attempt.error.retry_safe
                replicas.release(current, failed=failed_over)
                current = None
                emit_after(self.middleware, "request", ctx, req, attempt)
                if req.retry_in is None:
                    break
                req.attempt += 1
                await asyncio.sleep(req.retry_in)
                while current is None:
                    if ctx.stop_reason is not None:
                        return  # stopped while failing over: stays pending for the next delivery
                    current = replicas.try_acquire(req.avoid)
                    if current is None:
                        await replicas.wait_changed()
            await flusher.add(_result(line, req, attempt))
        finally:
            if current is not None:
                replicas.release(current)

    async def _send(self, slot: ReplicaSlot, endpoint: str, req: OutgoingRequest) -> tuple[int, str]:
        payload = json.dumps(req.body).encode()
        async with slot.client.open(
            "POST",
            endpoint,
            body=payload,
            headers=req.headers,
            timeout=self.request_timeout_s,
            raise_for_status=False,
        ) as resp:
            raw = await resp.read()
        return resp.status, raw.decode("utf-8", errors="replace")


def _json_or_none(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # a replica's answer nested too deep
        return None
    return value if isinstance(value, dict) else None


def _result(line: PendingLine, req: OutgoingRequest, attempt: Attempt) -> LineResult:
    request_id = req.headers.get("X-Request-Id", "")
    body = _json_or_none(attempt.body)
    if attempt.status is not None and attempt.status < 400 and body is not None:
        usage = body.get("usage")
        return LineResult.ok(
            line.line_no, request_id, attempt.body or "null", usage if isinstance(usage, dict) else None
        )
    if attempt.status is not None and attempt.status >= 400:
        # An HTTP error answer: OpenAI puts it in the error file with its status and body.
        text = (
            attempt.body
            if body is not None
            else json.dumps({"error": {"message": (attempt.body or "")[:1000]}})
        )
        return LineResult.http_error(line.line_no, attempt.status, request_id, text or "null")
    err = attempt.error or ReplicaUnavailable("the replica answered with something that is not JSON")
    code = "replica_unavailable" if err.retry_safe else "replica_error"
    return LineResult.failure(line.line_no, code, str(err))
