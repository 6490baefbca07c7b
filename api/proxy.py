"""The streaming proxy: admission wait, routing, one retry before the first token, SSE pass-through.

Route handlers validate and plan a request, then return a :class:`ProxyResponse`; everything
that waits happens inside it, where the client's disconnect is watched:

1. **Admission** (:class:`~priority.admission.Admission`): admitted at once, queued (bounded,
   class priority, until the class's wait budget), overflowed to the external provider, or
   refused with 429 and ``Retry-After``.
2. **Routing** (:class:`~router.framework.Router`) over the pool's replica views; a LoRA adapter
   the chosen replica lacks is loaded first (:class:`~router.adapters.AdapterManager`).
3. **Upstream**: the request goes to the replica's pooled connection with vLLM ``priority`` set
   from the class. Until the first token nothing reaches the client, so a failure there
   (connection refused, 5xx, 429/503 from the engine, an error event, the replica marked
   unhealthy) is retried once on another replica. After that the bytes stream through untouched
   (an upstream chunk is parsed only until the first token); a failure mid-stream ends the stream
   with ``data: {"error": {..., "code": "upstream_failed", "retryable": true}}`` and
   ``data: [DONE]``. A non-streaming request is answered only once its stream has ended, so a
   stream that breaks part-way is retried once like a failure before the first token.
4. **Disconnect**: when the client goes away the upstream connection is closed (vLLM aborts the
   request), a queued request leaves the queue, and nothing more is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from tidal.api.assemble import Assembler, assemblable, streamed_body
from tidal.api.errors import error_body
from tidal.api.metrics import GatewayMetrics
from tidal.clock import Clock
from tidal.fleet import QuotaSpec
from tidal.logs import ACCESS, REQUEST_ID
from tidal.priority.admission import Admission, Decision, Outcome, Ticket, Verdict
from tidal.priority.features import RequestPlan
from tidal.priority.quotas import LocalQuotas, QuotaStore, QuotaUnavailable, QuotaVerdict, Reservation
from tidal.replicas.client import ReplicaClient, UpstreamStream
from tidal.replicas.errors import (
    ReplicaError,
    ReplicaServerError,
    ReplicaStreamError,
    ReplicaUnavailable,
    error_from_status,
)
from tidal.replicas.wire.http1 import HeaderError
from tidal.replicas.wire.sse import Event, SSEDecoder, SSEError
from tidal.router.adapters import AdapterManager
from tidal.router.framework import Router
from tidal.router.registry import ReplicaRegistry, ReplicaState
from tidal.router.types import RouteRequest

__all__ = ["Proxy", "ProxyJob", "ProxyResponse", "UpstreamHandle"]

log = logging.getLogger(__name__)

# Completion tokens a request that sets no max_tokens is counted for until it ends.
RESERVED_COMPLETION_TOKENS = 1024

# Request ids: a random per-process prefix and a counter (uuid4 per request costs more).
_ID_PREFIX = f"tidal-{secrets.token_hex(6)}-"
_IDS = itertools.count(1)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_STREAM_FAILED = (
    b'data: {"error": {"message": "the replica failed while streaming; the request may be retried", '
    b'"type": "server_error", "param": null, "code": "upstream_failed", "retryable": true}}\n\n'
    b"data: [DONE]\n\n"
)


class _Aborted(ReplicaUnavailable):
    """The attempt was aborted on purpose (replica marked unhealthy, or the client left)."""


class UpstreamHandle:
    """One attempt on one upstream; :meth:`abort` fails it fast from another task."""

    __slots__ = ("reason", "resp", "task")

    def __init__(self) -> None:
        self.resp: UpstreamStream | None = None
        self.task: asyncio.Task[Any] | None = None  # set while waiting for response headers
        self.reason: str | None = None

    def abort(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        if self.resp is not None:
            self.resp.abort()
        elif self.task is not None:
            self.task.cancel()


@dataclass(eq=False)
class ProxyJob:
    """One request on its way through the proxy."""

    path: str
    body: dict[str, Any]
    stream: bool
    plan: RequestPlan
    route: RouteRequest
    adapter: str | None
    arrived: float
    request_id: str = field(default_factory=lambda: f"{_ID_PREFIX}{next(_IDS):x}")
    client_gone: bool = False
    sent: bool = False
    prefilled: bool = False
    handle: UpstreamHandle | None = None
    waiter: asyncio.Future[str] | None = None
    raw_send: Send | None = None  # the server's send, past the middleware wrappers
    # The server's body writer (api.protocol.BodyWriter), past the middleware wrappers.
    raw_write: Callable[[bytes], Coroutine[Any, Any, None] | None] | None = None
    tenant: str = ""
    completion_tokens: int | None = None  # what the answer generated, once known
    replica: str | None = None  # the upstream of the last attempt

    def disconnected(self) -> None:
        self.client_gone = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result("gone")
        if self.handle is not None:
            self.handle.abort("the client went away")


_HOLD_LIMIT = 256 * 1024
_OUTPUT_KEYS = ("content", "tool_calls", "reasoning_content", "reasoning")
_ASSEMBLED = {"/v1/chat/completions": True, "/v1/completions": False}  # path -> chat
_CHOICE_INDEX = re.compile(rb'"index":\s*(\d+)')


def _is_output(choice: dict[str, Any]) -> bool:
    """A generated token counts even when its text is empty (a token that decodes to nothing yet,
    or a special one): only chat's opening role chunk is not output."""
    if isinstance(choice.get("text"), str) or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and (
        any(delta.get(k) for k in _OUTPUT_KEYS)
        or ("role" not in delta and any(delta.get(k) is not None for k in _OUTPUT_KEYS))
    )


class _Watch:
    """Reads the replica's SSE events as they pass (the bytes themselves go on untouched): the
    first event that carries output, an error or the end; then when output arrives, how many
    events each choice got, and the usage chunk's token count. With an ``assembler`` every
    parsed chunk also goes to it (a non-streaming answer built from the stream).

    Before the first output the stream is held, at most ``limit`` bytes: past that it is passed
    through as started, so the hold is bounded."""

    __slots__ = (
        "_decoder",
        "_last",
        "_left",
        "_now",
        "_one_choice",
        "_passing",
        "_t_before",
        "_tail",
        "assembler",
        "broken",
        "completion_tokens",
        "done",
        "error",
        "outputs",
        "t_first",
        "t_last",
    )

    def __init__(
        self, clock: Clock, assembler: Assembler | None = None, limit: int = _HOLD_LIMIT, choices: int = 1
    ) -> None:
        self._now = clock.now
        self._one_choice = choices == 1
        self._passing = False  # past the first token of one choice passed through: see feed
        self._decoder = SSEDecoder()
        self._left = limit
        self._last: bytes | None = None  # the last event counted unparsed (one choice)
        self._tail = 0  # events counted unparsed, the last included
        self._t_before = 0.0  # t_last before the last event counted unparsed
        self.assembler = assembler
        self.outputs: dict[int, int] = {}
        self.completion_tokens: int | None = None
        self.error: dict[str, Any] | None = None
        self.done = False
        self.broken = False  # the bytes broke the SSE rules: passed on, no longer read
        self.t_first: float | None = None
        self.t_last = 0.0

    def feed(self, piece: bytes) -> str | None:
        """The kind of the first event of note in ``piece``: ``"token"``, ``"error"``, ``"done"``
        (or ``"token"`` once the hold limit is passed), else ``None``."""
        self._left -= len(piece)
        if (
            # Past the first token of one choice passed through, a piece of whole single-line
            # data events (tokens, the usage chunk, the end) with nothing pending is counted
            # here, without the decoder: this runs once per streamed token.
            self._passing
            and piece[-2:] == b"\n\n"
            and piece[:6] == b"data: "
            and b"\r" not in piece
            and self._decoder.idle
        ):
            lines = piece.count(b"\n")
            if lines == 2:  # one event, the usual piece
                self._count_one(piece[6:-2])
                return "token"
            # Several (the replica's writes arrived together): when the n - 1 joins "\n\ndata: "
            # and the final blank line hold every line feed, each event is one "data: " line.
            if not lines & 1 and piece.count(b"\n\ndata: ") == (lines >> 1) - 1:
                for data in piece[6:-2].split(b"\n\ndata: "):
                    self._count_one(data)
                return "token"
        if self.broken:
            return "token"
        try:
            events = self._decoder.feed(piece)
        except SSEError:
            self.broken = True
            return "token"
        if self.t_first is not None and self.assembler is None:
            self._count(events)
            return "token"
        kind: str | None = None
        output = False
        for event in events:
            if event.data == b"[DONE]":
                self.done = True
                kind = kind or "done"
                continue
            found = self._parsed(event.data)
            output = output or found == "token"
            kind = kind or found
        if output:
            self.t_last = self._now()
            if self.t_first is None:
                self.t_first = self.t_last
                self._passing = self._one_choice and self.assembler is None
        return kind or ("token" if self._left < 0 else None)

    def _parsed(self, data: bytes) -> str | None:
        """Read one event's JSON: ``"token"`` when it carried output, ``"error"`` for an error."""
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: a replica's event nested too deep
            return None
        if not isinstance(obj, dict):
            return None
        if self.assembler is not None:
            self.assembler.add(obj)
        if "error" in obj and not obj.get("choices"):
            self.error = obj
            return "error"
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        found = None
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and _is_output(choice):
                index = choice.get("index", 0)
                self.outputs[index] = self.outputs.get(index, 0) + 1
                found = "token"
        return found

    def _count(self, events: list[Event]) -> None:
        """Past the first token of a stream passed through: count output events per choice
        without parsing each one. With one choice every event but ``[DONE]`` is counted and only
        the last one is kept, parsed once when the count is asked for (:meth:`_settle`): a usage
        chunk, or an error, ends a stream. With several, a chunk's first ``"index"`` is its
        choice's (as vLLM and OpenAI order the keys), and usage or error chunks are parsed."""
        if not events:
            return
        if self._one_choice:
            for data, *_ in events:
                self._count_one(data)
            return
        output = False
        outputs = self.outputs
        for data, *_ in events:
            if data == b"[DONE]":
                self.done = True
            elif b'"usage"' in data or b'"error"' in data:
                output = self._parsed(data) == "token" or output
            elif b'"role"' not in data:
                m = _CHOICE_INDEX.search(data)
                index = int(m.group(1)) if m else 0
                outputs[index] = outputs.get(index, 0) + 1
                output = True
        if output:
            self.t_last = self._now()

    @property
    def mid_event(self) -> bool:
        """The bytes fed so far end inside an event (or broke the SSE rules)."""
        return self.broken or not self._decoder.idle

    def _count_one(self, data: bytes) -> None:
        """One event of a one-choice stream past its first token, counted unparsed."""
        if data == b"[DONE]":
            self.done = True
        else:
            self._tail += 1
            self._last = data
            self._t_before = self.t_last
            self.t_last = self._now()

    def _settle(self) -> None:
        """Fold the events counted unparsed into ``outputs``: the last one is read, and left out
        of the count (with its time) when it carried no output (a usage-only chunk, an error)."""
        if self._last is None:
            return
        last, self._last = self._last, None
        before = self.outputs.get(0, 0)
        output = self._parsed(last) == "token"
        self.outputs[0] = before + self._tail - 1 + (1 if output else 0)
        if not output:
            self.t_last = self._t_before
        self._tail = 0

    def tokens_per_choice(self) -> int:
        """Output tokens of one choice: the usage count shared by the choices when the replica
        sent one, else the output events of the longest choice."""
        self._settle()
        if not self.outputs:
            return 0
        if self.completion_tokens is not None:
            return self.completion_tokens // len(self.outputs)
        return max(self.outputs.values())

    def tpot(self) -> float | None:
        tokens = self.tokens_per_choice()
        if self.t_first is None or tokens < 4:
            return None
        return (self.t_last - self.t_first) / (tokens - 1)


def _adding_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """``send`` with ``headers`` added to the response's start (the body passes untouched)."""
    if not headers:
        return send

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


async def _send_json(
    send: Send, status: int, body: dict[str, Any] | bytes, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _json_dict(raw: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _upstream_error_body(status: int, raw: bytes) -> dict[str, Any]:
    """A replica's error, reshaped as OpenAI's (vLLM puts the HTTP status in ``code``)."""
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        parsed = None
    err = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or raw[:500].decode(errors="replace"))
        param = err.get("param") if isinstance(err.get("param"), str) else None
        code = err.get("code")
        return error_body(status, message, param=param, code=code if isinstance(code, str) else None)
    return error_body(
        status, raw[:500].decode(errors="replace").strip() or f"upstream answered HTTP {status}"
    )


@dataclass
class _Target:
    """Where one attempt goes: a replica of the registry, or the external provider."""

    name: str
    client: ReplicaClient
    state: ReplicaState | None = None


class Proxy:
    """Runs a :class:`ProxyJob` to completion, writing the HTTP response with raw ASGI ``send``."""

    def __init__(
        self,
        *,
        registry: ReplicaRegistry,
        router: Router,
        admission: Admission,
        adapters: AdapterManager,
        metrics: GatewayMetrics,
        clock: Clock,
        external: ReplicaClient | None = None,
        external_model: str | None = None,
        retry_before_first_token: bool = True,
        quotas: QuotaStore | None = None,
        quota_of: Callable[[str], QuotaSpec | None] | None = None,
    ) -> None:
        self.registry = registry
        self.router = router
        self.admission = admission
        self.adapters = adapters
        self.metrics = metrics
        self.clock = clock
        self.external = external
        self.external_model = external_model
        self.attempts = 2 if retry_before_first_token else 1
        self.quotas = quotas
        self.quota_of = quota_of
        # Where a tenant is counted while the shared store does not answer: this gateway alone.
        self.local_quotas = LocalQuotas(clock)
        self._store_down = False

    # -- capacity ---------------------------------------------------------------------------------

    def slot_freed(self, pool: str) -> None:
        """Hand freed slots to waiting requests (most urgent class first)."""
        for ticket in self.admission.wake(pool):
            fut = ticket.payload
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_result("granted")
            else:
                self.admission.release(ticket)

    # -- entry point ------------------------------------------------------------------------------

    async def run(self, job: ProxyJob, send: Send) -> None:
        plan = job.plan
        reservation: Reservation | None = None
        counted_by: QuotaStore = self.local_quotas
        quota = self.quota_of(job.tenant) if self.quota_of is not None else None
        if quota is not None and (quota.requests_per_minute or quota.tokens_per_minute):
            allowed, counted_by = await self._take_quota(job, quota)
            send = _adding_headers(send, allowed.headers())  # on every answer, good or bad
            if not allowed.allowed:
                await self._quota_refused(job, allowed, send)
                return
            reservation = allowed.reservation
        # No coroutine of its own for the rest: a stream resumes once per token through every
        # frame awaiting it.
        try:
            if plan.external or plan.pool is None:
                await self._external(job, send)
                return
            await self._admit_and_serve(job, plan.pool, send)
        finally:
            if reservation is not None and job.completion_tokens is not None:
                # In the store that counted it; unsettled, the reservation stands (the tenant is
                # counted for what it might have used).
                with contextlib.suppress(QuotaUnavailable):
                    await counted_by.settle(reservation, plan.prompt_tokens + job.completion_tokens)

    async def _take_quota(self, job: ProxyJob, quota: QuotaSpec) -> tuple[QuotaVerdict, QuotaStore]:
        """Count the request against its tenant's limits: prompt plus ``max_tokens`` (or
        :data:`RESERVED_COMPLETION_TOKENS` when it sets none) until the answer says what it used.
        Returns the verdict and the store that counted it."""
        tokens = job.plan.prompt_tokens + (job.plan.max_tokens or RESERVED_COMPLETION_TOKENS)
        if self.quotas is not None:
            try:
                verdict = await self.quotas.take(job.tenant, quota, tokens)
                self._store_down = False
                return verdict, self.quotas
            except QuotaUnavailable as exc:
                if not self._store_down:
                    log.warning("quota store unavailable (%s); counting on this gateway alone", exc)
                    self._store_down = True
        return await self.local_quotas.take(job.tenant, quota, tokens), self.local_quotas

    async def _quota_refused(self, job: ProxyJob, verdict: QuotaVerdict, send: Send) -> None:
        exceeded = verdict.exceeded
        kind = exceeded.kind if exceeded is not None else "requests"
        self.metrics.tenant_refused(job.tenant, f"quota_{kind}")
        await _send_json(
            send,
            429,
            error_body(429, verdict.message(job.tenant), type_=kind, code="rate_limit_exceeded"),
            ((b"retry-after", str(verdict.retry_after_s).encode()),),
        )

    async def _admit_and_serve(self, job: ProxyJob, pool: str, send: Send) -> None:
        plan = job.plan
        verdict, ticket = self.admission.offer(
            pool,
            plan.class_name,
            priority=plan.class_spec.priority,
            wait_budget_s=plan.class_spec.wait_budget_s,
            feature=plan.feature,
            regulated=not plan.overflow_allowed,
            tenant=job.tenant,
        )
        try:
            if verdict.decision is Decision.QUEUE:
                verdict = await self._wait(job, ticket)
                if job.client_gone:
                    return
            if verdict.decision is Decision.REJECT:
                retry_after = verdict.retry_after_s or 1
                await _send_json(
                    send,
                    429,
                    error_body(
                        429,
                        f"The '{pool}' pool is saturated ({verdict.reason}); retry after {retry_after} s.",
                        code="pool_saturated",
                    ),
                    ((b"retry-after", str(retry_after).encode()),),
                )
                self.metrics.request_done(pool, None, failed=False)
                return
            if verdict.decision is Decision.OVERFLOW:
                await self._external(job, send)
                return
            self.metrics.queued(pool, job.plan.class_name, ticket.waited_s)
            await self._serve(job, ticket, send)
        finally:
            self.admission.finished(ticket)

    async def _wait(self, job: ProxyJob, ticket: Ticket) -> Verdict:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        ticket.payload = fut
        job.waiter = fut
        try:
            result = await asyncio.wait_for(fut, max(0.0, ticket.deadline - self.clock.now()))
        except TimeoutError:
            late = self.admission.expire(ticket)
            return late if late is not None else Verdict(Decision.ADMIT)
        finally:
            job.waiter = None
        if result == "gone":
            self.admission.withdraw(ticket)
            return Verdict(Decision.REJECT, retry_after_s=1, reason="the client went away")
        if result == "pushed_out" and ticket.verdict is not None:
            return ticket.verdict
        return Verdict(Decision.ADMIT)

    def pushed_out(self, ticket: Ticket) -> None:
        """Admission made room in a full queue by refusing ``ticket`` (its verdict says how)."""
        fut = ticket.payload
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_result("pushed_out")

    # -- replicas ---------------------------------------------------------------------------------

    async def _serve(self, job: ProxyJob, ticket: Ticket, send: Send) -> None:
        pool = job.plan.pool
        assert pool is not None
        tried: list[str] = []
        last: ReplicaError | None = None
        started = False
        for attempt in range(self.attempts):
            views = self.registry.views(pool)
            result = self.router.route(job.route, views, exclude=tried)
            if result is None and tried and last is not None and last.status is None:
                # A connection-level failure (e.g. a pooled connection the replica had just
                # closed) and no other replica: the same one may take it.
                result = self.router.route(job.route, views)
            state = self.registry.get(result.replica.name) if result is not None else None
            if state is None or not isinstance(state.client, ReplicaClient):
                break
            self.registry.acquire(state, job.adapter, job.plan.prompt_tokens)
            if not started:
                self.admission.started(ticket)
                started = True
            last = await self._attempt(
                job, _Target(state.name, state.client, state), send, attempt + 1 < self.attempts
            )
            if last is None or job.sent or job.client_gone:
                return
            tried.append(state.name)
            self.metrics.retries.labels(type(last).__name__).inc()
        if not started:
            self.admission.release(ticket)
            self.slot_freed(pool)
        if job.client_gone or job.sent:
            return
        self.admission.count(job.plan.class_name, job.plan.feature, Outcome.ERRORS)
        if last is None:
            await _send_json(
                send,
                503,
                error_body(
                    503, f"No replica of the '{pool}' pool can take this request now.", code="no_replica"
                ),
                ((b"retry-after", b"1"),),
            )
        else:
            await _send_json(
                send,
                502,
                error_body(
                    502, f"The replica failed before answering: {last.message}", code="upstream_failed"
                ),
            )

    async def _external(self, job: ProxyJob, send: Send) -> None:
        if self.external is None:
            await _send_json(
                send, 503, error_body(503, "No external provider is configured.", code="no_external_provider")
            )
            return
        if self.external_model:
            job.body["model"] = self.external_model
        job.body.pop("priority", None)  # a vLLM extension other providers may refuse
        err = await self._attempt(job, _Target("external", self.external), send, False)
        self.metrics.overflow_requests.labels("error" if err is not None else "ok").inc()
        if err is not None and not job.sent and not job.client_gone:
            await _send_json(
                send,
                502,
                error_body(502, f"The external provider failed: {err.message}", code="upstream_failed"),
            )

    async def _attempt(
        self, job: ProxyJob, target: _Target, send: Send, may_retry: bool
    ) -> ReplicaError | None:
        """One try on one upstream. Returns the error when it failed before anything was sent to
        the client (the caller may retry), else ``None`` (a response, good or bad, was sent).

        A replica gets every chat and text completion streamed: a non-streaming request is
        answered with the JSON assembled from the stream (:mod:`api.assemble`), so that it is
        measured, retried and counted like a streaming one. The external provider gets the
        request as the client sent it."""
        handle = UpstreamHandle()
        job.handle = handle
        job.replica = target.name
        job.prefilled = False
        state = target.state
        if state is not None:
            state.handles.add(handle)
        tpot: float | None = None
        failed = False
        chat = _ASSEMBLED.get(job.path)
        assemble = state is not None and not job.stream and chat is not None and assemblable(job.body)
        try:
            if (
                state is not None
                and job.adapter is not None
                and await self.adapters.ensure(state, job.adapter)
            ):
                self.metrics.adapter_loads.labels(state.name).inc()
            if handle.reason is not None:
                raise _Aborted(handle.reason, replica=target.name)
            body = json.dumps(streamed_body(job.body) if assemble else job.body).encode()
            async with AsyncExitStack() as stack:
                handle.task = asyncio.current_task()
                try:
                    resp = await stack.enter_async_context(
                        target.client.forward(job.path, body, {"X-Request-Id": job.request_id})
                    )
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if handle.reason is not None and task is not None and task.uncancel() == 0:
                        raise _Aborted(handle.reason, replica=target.name) from None
                    raise
                finally:
                    handle.task = None
                handle.resp = resp
                if handle.reason is not None:
                    raise _Aborted(handle.reason, replica=target.name)
                if resp.status >= 400:
                    raw = await resp.read()
                    err = error_from_status(
                        resp.status, _json_dict(raw), raw.decode(errors="replace"), target.name
                    )
                    failed = resp.status >= 500 or resp.status == 429
                    if err.retry_safe and may_retry:
                        return err
                    await _send_json(send, resp.status, _upstream_error_body(resp.status, raw))
                    job.sent = True
                    return None
                if assemble and not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    assemble = False  # a replica that answered in one piece: passed on as it is
                if not job.stream and not assemble:
                    raw = await resp.read()
                    ctype = resp.headers.get("content-type", "application/json").encode()
                    await send(
                        {
                            "type": "http.response.start",
                            "status": resp.status,
                            "headers": [
                                (b"content-type", ctype),
                                (b"content-length", str(len(raw)).encode()),
                                (b"x-request-id", job.request_id.encode()),
                            ],
                        }
                    )
                    await send({"type": "http.response.body", "body": raw})
                    job.sent = True
                    return None
                n = job.body.get("n")
                choices = n if isinstance(n, int) and n > 1 else 1
                watch = _Watch(self.clock, Assembler(chat=bool(chat)) if assemble else None, choices=choices)
                tpot, failed = await self._stream(job, resp, watch, send, may_retry, target)
                job.completion_tokens = watch.tokens_per_choice() * choices
                return None
        except HeaderError as exc:
            if not job.sent and not job.client_gone:
                await _send_json(send, 400, error_body(400, str(exc), code="invalid_header"))
                job.sent = True
            return None
        except ReplicaError as exc:
            if job.client_gone:
                return None  # the client left: not the replica's failure
            failed = True
            if state is not None:
                self.metrics.upstream_errors.labels(state.name).inc()
            if job.sent:  # _stream already ended the client's stream
                return None
            return exc
        finally:
            job.handle = None
            if state is not None:
                state.handles.discard(handle)
                self.registry.release(
                    state,
                    adapter=job.adapter,
                    tpot_s=tpot,
                    failed=failed,
                    pending_prompt_tokens=0 if job.prefilled else job.plan.prompt_tokens,
                )
                self.admission.completed(state.pool)
                self.metrics.request_done(state.pool, state.group, failed=failed)
                if tpot is not None:
                    self.metrics.token_time(state.pool, job.plan.class_name, tpot)
                self.slot_freed(state.pool)

    async def _stream(
        self,
        job: ProxyJob,
        resp: UpstreamStream,
        watch: _Watch,
        send: Send,
        may_retry: bool,
        target: _Target,
    ) -> tuple[float | None, bool]:
        """Hold the stream until its first token, then pass it through (or, assembling, read it
        to its end). Raises before anything was sent; returns ``(tpot, failed)`` once the client
        has its answer."""
        buffered: list[bytes] = []
        kind: str | None = None
        chunks = resp.iter_chunks()
        async for piece in chunks:
            buffered.append(piece)
            kind = watch.feed(piece)
            if kind is not None:
                break
        if kind == "error" and may_retry:
            raise ReplicaServerError("the replica sent an error before the first token", replica=target.name)
        if kind is None and not buffered:
            raise ReplicaStreamError("the replica closed the stream without output", replica=target.name)
        t_first = watch.t_first if watch.t_first is not None else self.clock.now()
        if target.state is not None and not job.prefilled:
            job.prefilled = True  # its prompt no longer counts as prefill work queued there
            self.registry.first_token(target.state, job.plan.prompt_tokens)
        self.metrics.first_token(job.plan.pool or "external", job.plan.class_name, t_first - job.arrived)
        if watch.assembler is not None:
            return await self._assembled(job, chunks, watch, send, kind, may_retry)
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [*_SSE_HEADERS, (b"x-request-id", job.request_id.encode())],
            }
        )
        job.sent = True
        await send({"type": "http.response.body", "body": b"".join(buffered), "more_body": True})
        failed = kind == "error"
        if kind == "token":
            raw = job.raw_send or send
            write = job.raw_write
            feed = watch.feed
            try:
                if write is not None:
                    # Each piece goes out from the replica connection's read callback: no task
                    # switch per token.

                    def sink(piece: bytes) -> Coroutine[Any, Any, None] | None:
                        feed(piece)
                        return write(piece)

                    await resp.relay(sink)
                else:
                    async for piece in chunks:
                        await raw({"type": "http.response.body", "body": piece, "more_body": True})
                        feed(piece)
            except ReplicaStreamError:
                if job.client_gone:
                    return None, False
                failed = True
                # The bytes passed on may end inside an event: end it, or the error event would
                # join its last line and neither would parse.
                tail = b"\n\n" + _STREAM_FAILED if watch.mid_event else _STREAM_FAILED
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        if not job.client_gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return (None if failed else watch.tpot()), failed

    async def _assembled(
        self,
        job: ProxyJob,
        chunks: AsyncIterator[bytes],
        watch: _Watch,
        send: Send,
        kind: str | None,
        may_retry: bool,
    ) -> tuple[float | None, bool]:
        """Read the rest of the stream, then answer with the assembled JSON (or the error). A
        stream that breaks raises while a retry is allowed: the client has seen nothing yet."""
        assert watch.assembler is not None
        try:
            if kind == "token":
                async for piece in chunks:
                    watch.feed(piece)
        except ReplicaStreamError as exc:
            if job.client_gone:
                return None, False
            if may_retry:
                raise
            await _send_json(
                send,
                502,
                error_body(502, f"The replica failed while answering: {exc.message}", code="upstream_failed"),
            )
            job.sent = True
            return None, True
        if watch.error is not None or watch.broken:
            err = watch.error.get("error") if watch.error is not None else None
            code = err.get("code") if isinstance(err, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 502
            raw = json.dumps(watch.error).encode() if watch.error is not None else b"broken event stream"
            await _send_json(send, status, _upstream_error_body(status, raw))
            job.sent = True
            return None, status >= 500
        await _send_json(send, 200, watch.assembler.result(), ((b"x-request-id", job.request_id.encode()),))
        job.sent = True
        return watch.tpot(), False


class ProxyResponse(Response):
    """A response whose body is produced by the proxy, with the client's disconnect watched."""

    def __init__(self, job: ProxyJob, run: Callable[[ProxyJob, Send], Coroutine[Any, Any, None]]) -> None:
        self.job = job
        self._run = run
        self.status_code = 200
        self.background = None
        self.init_headers({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.bind(scope)
        await self.watched(receive, send)

    def bind(self, scope: Scope) -> None:
        """Take the server's own ``send`` and body writer from ``scope``, where no middleware
        watches the chunks (:class:`~api.app.GatewayApp` puts them there)."""
        self.job.raw_send = scope.get("tidal.send")
        self.job.raw_write = scope.get("tidal.write")

    async def watched(self, receive: Receive, send: Send) -> None:
        """Run the job, marking it disconnected when ``receive`` says the client went away."""
        job = self.job

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    job.disconnected()
                    return

        loop = asyncio.get_running_loop()
        watcher = loop.create_task(watch())
        status: list[int] = []
        if ACCESS.isEnabledFor(logging.INFO):
            send = _status_into(send, status)
        token = REQUEST_ID.set(job.request_id)  # its log lines name it
        started = time.monotonic()
        try:
            await self._run(job, send)
        finally:
            REQUEST_ID.reset(token)
            watcher.cancel()
            if ACCESS.isEnabledFor(logging.INFO):
                _access(job, status[0] if status else None, time.monotonic() - started)


def _status_into(send: Send, status: list[int]) -> Send:
    """``send``, noting the response's status in ``status`` (for the access log)."""

    async def noting(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        await send(message)

    return noting


def _access(job: ProxyJob, status: int | None, seconds: float) -> None:
    """The request's access-log line (:mod:`tidal.logs`)."""
    ACCESS.info(
        "request",
        extra={
            "request_id": job.request_id,
            "method": "POST",
            "path": job.path,
            "status": status if status is not None else 499 if job.client_gone else None,
            "tenant": job.tenant,
            "feature": job.plan.feature,
            "model": job.body.get("model"),
            "pool": job.plan.pool or "external",
            "replica": job.replica,
            "stream": job.stream,
            "completion_tokens": job.completion_tokens,
            "duration_ms": round(seconds * 1000, 2),
        },
    )
