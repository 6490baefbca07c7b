"""Async, connection-pooled HTTP client for one replica (vLLM, simulated, or any compatible server).

Example::

    async with ReplicaClient("http://127.0.0.1:8001") as replica:
        reply = await replica.chat_completions({"model": "tiny", "messages": [...], "max_tokens": 8})
        async for chunk in replica.stream_chat_completions({...}):
            print(chunk["choices"][0]["delta"].get("content", ""), end="")
        snap = await replica.load_snapshot()

Failures raise the typed errors of :mod:`replicas.errors`, which say whether another replica may
take the same request. :meth:`ReplicaClient.open` is the raw primitive: it gives the status and
an iterator of the upstream bytes, untouched; :meth:`ReplicaClient.forward` is the same for the
gateway's proxy on a leaner connection pool (:mod:`replicas.wire.http1`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Literal, Protocol

import aiohttp

from tidal.replicas.errors import (
    ReplicaError,
    ReplicaStreamError,
    ReplicaTimeout,
    ReplicaUnavailable,
    error_from_status,
)
from tidal.replicas.metrics import LoadSnapshot, parse_load_snapshot
from tidal.replicas.wire.http1 import ConnectionPool, check_header
from tidal.replicas.wire.sse import iter_data as iter_sse_events

__all__ = ["ReplicaClient", "Transport", "UpstreamResponse", "UpstreamStream", "iter_sse_events"]

_JSON = {"Content-Type": "application/json"}
_MAX_BODY = 64 * 1024 * 1024

Transport = Literal["lean", "aiohttp"]


class UpstreamStream(Protocol):
    """A response the proxy reads: :class:`~replicas.wire.http1.LeanResponse` or
    :class:`UpstreamResponse`."""

    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    async def relay(self, sink: Callable[[bytes], Awaitable[None] | None]) -> None: ...

    async def read(self) -> bytes: ...

    def abort(self) -> None: ...


class UpstreamResponse:
    """A response being received from a replica: status, headers and the raw body stream."""

    def __init__(self, resp: aiohttp.ClientResponse, replica: str) -> None:
        self._resp = resp
        self.replica = replica
        self.status = resp.status
        self.headers = resp.headers

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in whatever pieces the network delivers."""
        try:
            async for data in self._resp.content.iter_any():
                yield data
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise ReplicaStreamError(f"stream from replica broke: {exc!r}", replica=self.replica) from exc

    async def relay(self, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Hand the body to ``sink`` as it arrives (see
        :meth:`~replicas.wire.http1.LeanResponse.relay`; here a task switch per piece)."""
        async for piece in self.iter_chunks():
            blocked = sink(piece)
            if blocked is not None:
                await blocked

    def abort(self) -> None:
        """Close the connection now: a reader of :meth:`iter_chunks` gets a
        :class:`~replicas.errors.ReplicaStreamError` and the replica sees the client go away
        (vLLM then aborts the request)."""
        self._resp.close()

    async def read(self, max_bytes: int = _MAX_BODY) -> bytes:
        """The whole body, at most ``max_bytes`` of it (more aborts the response and raises
        :class:`~replicas.errors.ReplicaUnavailable`)."""
        parts: list[bytes] = []
        size = 0
        try:
            async for data in self._resp.content.iter_any():
                size += len(data)
                if size > max_bytes:
                    self.abort()
                    raise ReplicaUnavailable(f"the reply is over {max_bytes} bytes", replica=self.replica)
                parts.append(data)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise ReplicaUnavailable(f"reading the reply failed: {exc!r}", replica=self.replica) from exc
        return b"".join(parts)


class ReplicaClient:
    """One replica's HTTP API with a keep-alive connection pool.

    **Parameters:**

    * ``base_url`` -- e.g. ``http://10.0.0.7:8000`` (no trailing ``/v1``).
    * ``api_key`` -- sent as ``Authorization: Bearer``, if the replica wants one.
    * ``pool_size`` -- most simultaneous connections to this replica.
    * ``connect_timeout`` / ``read_timeout`` -- seconds; ``read_timeout`` bounds the wait for each
      piece of the body (and so the first token), not the whole stream.
    * ``keepalive_s`` -- how long an idle pooled connection is kept (below the server's own
      keep-alive timeout, 5 s for vLLM's uvicorn).
    * ``transport`` -- what :meth:`forward` sends with: ``"lean"``, the gateway's own HTTP/1.1
      pool (:mod:`replicas.wire.http1`), or ``"aiohttp"`` (the maintained client; the one for an
      external provider on the internet). ``tidal bench gateway`` measures the two side by side.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        pool_size: int = 512,
        connect_timeout: float = 3.0,
        read_timeout: float | None = 600.0,
        name: str | None = None,
        keepalive_s: float = 4.0,
        transport: Transport = "lean",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.transport = transport
        self.name = name or self.base_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool_size = pool_size
        self._keepalive_s = keepalive_s
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._lean: ConnectionPool | None = None
        # sock_connect, not connect: aiohttp's ``connect`` also bounds the wait for a free pooled
        # connection, which under load is queueing, not a replica failing to answer.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle connections are dropped before uvicorn's (vLLM's) 5 s keep-alive timeout, so a
            # request is not written onto a connection the server is closing at that moment.
            connector = aiohttp.TCPConnector(
                limit=self._pool_size, keepalive_timeout=self._keepalive_s, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers, auto_decompress=False
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
        if self._lean is not None:
            await self._lean.close()
            self._lean = None

    async def __aenter__(self) -> ReplicaClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- raw primitive ---------------------------------------------------------------------------

    @asynccontextmanager
    async def open(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        raise_for_status: bool = True,
    ) -> AsyncIterator[UpstreamResponse]:
        """Send a request and hold the response open while the caller reads it.

        With ``raise_for_status`` an error status raises the typed error (body read and parsed);
        otherwise the caller gets the response whatever its status.
        """
        session = self._get_session()
        hdrs = dict(_JSON) if body is not None else {}
        if headers:
            hdrs.update(headers)
        # No timeout named: the client's own (connect, and each read). aiohttp reads ``None`` as
        # "no timeout at all", which let a replica that accepted and never answered hold the caller.
        req_timeout = (
            aiohttp.ClientTimeout(total=timeout, sock_connect=self._connect_timeout)
            if timeout
            else self._timeout
        )
        try:
            cm = session.request(method, self.base_url + path, data=body, headers=hdrs, timeout=req_timeout)
            resp = await cm.__aenter__()
        except TimeoutError as exc:
            raise ReplicaTimeout(f"{method} {path} timed out", replica=self.name) from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise ReplicaUnavailable(f"{method} {path} failed: {exc!r}", replica=self.name) from exc
        try:
            if raise_for_status and resp.status >= 400:
                raise await self._error(resp)
            yield UpstreamResponse(resp, self.name)
        finally:
            resp.release()
            await cm.__aexit__(None, None, None)

    @asynccontextmanager
    async def forward(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[UpstreamStream]:
        """The gateway proxy's primitive: ``POST`` a JSON ``body`` on a keep-alive connection of
        the client's ``transport`` and hold the response open, whatever its status. Failures
        before the response headers raise :class:`~replicas.errors.ReplicaUnavailable` or
        :class:`~replicas.errors.ReplicaTimeout`; headers HTTP cannot carry raise
        :class:`~replicas.wire.http1.HeaderError`."""
        if self.transport == "aiohttp":
            for name, value in (headers or {}).items():
                check_header(name, value)
            async with self.open("POST", path, body=body, headers=headers, raise_for_status=False) as up:
                yield up
            return
        if self._lean is None:
            self._lean = ConnectionPool(
                self.base_url,
                name=self.name,
                limit=self._pool_size,
                keepalive_s=self._keepalive_s,
                connect_timeout=self._connect_timeout,
                read_timeout=self._read_timeout,
                headers={**self._headers, "Content-Type": "application/json"},
            )
        async with self._lean.request("POST", path, body, headers) as resp:
            yield resp

    async def _error(self, resp: aiohttp.ClientResponse) -> ReplicaError:
        try:
            text = (await resp.read()).decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            text = ""
        body: dict[str, Any] | None = None
        try:
            parsed = json.loads(text) if text else None
            body = parsed if isinstance(parsed, dict) else None
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            body = None
        return error_from_status(resp.status, body, text, self.name)

    async def _json(
        self, method: str, path: str, payload: Any = None, *, timeout: float | None = None
    ) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        async with self.open(method, path, body=body, timeout=timeout) as resp:
            raw = await resp.read()
        try:
            return json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            return raw.decode(errors="replace")

    async def _stream(self, path: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = json.dumps({**payload, "stream": True}).encode()
        async with self.open("POST", path, body=body) as resp:
            async for data in iter_sse_events(resp.iter_chunks()):
                try:
                    event = json.loads(data)
                except (ValueError, RecursionError) as exc:
                    raise ReplicaStreamError(f"bad SSE payload {data[:80]!r}", replica=self.name) from exc
                if isinstance(event, dict) and "error" in event and "choices" not in event:
                    err = event["error"]
                    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    raise ReplicaStreamError(msg, body=event, replica=self.name)
                yield event

    # -- OpenAI-compatible API -------------------------------------------------------------------

    async def chat_completions(
        self, payload: dict[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", "/v1/chat/completions", payload, timeout=timeout)
        return result

    def stream_chat_completions(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self._stream("/v1/chat/completions", payload)

    async def completions(self, payload: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", "/v1/completions", payload, timeout=timeout)
        return result

    def stream_completions(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self._stream("/v1/completions", payload)

    async def embeddings(self, payload: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", "/v1/embeddings", payload, timeout=timeout)
        return result

    async def models(self) -> list[dict[str, Any]]:
        result = await self._json("GET", "/v1/models", timeout=10)
        data = result.get("data", []) if isinstance(result, dict) else []
        return [m for m in data if isinstance(m, dict)]

    async def health(self, timeout: float = 5.0) -> bool:
        """True when ``/health`` answers 200 within ``timeout``."""
        try:
            async with self.open("GET", "/health", timeout=timeout, raise_for_status=False) as resp:
                return resp.status == 200
        except ReplicaError:
            return False

    async def load_lora_adapter(self, name: str, path: str) -> str:
        result = await self._json(
            "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=120
        )
        return str(result)

    async def unload_lora_adapter(self, name: str) -> str:
        result = await self._json("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout=60)
        return str(result)

    async def metrics_text(self, timeout: float = 5.0) -> str:
        async with self.open("GET", "/metrics", timeout=timeout) as resp:
            return (await resp.read()).decode(errors="replace")

    async def load_snapshot(self, timeout: float = 5.0) -> LoadSnapshot:
        return parse_load_snapshot(await self.metrics_text(timeout))
