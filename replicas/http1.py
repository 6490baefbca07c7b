"""A lean HTTP/1.1 client for the gateway's streaming proxy: keep-alive connections to one origin
on asyncio protocols, responses parsed by ``httptools`` (the C parser uvicorn uses).

The proxy sends one request per stream and forwards the replica's bytes as they come. Through
aiohttp each request builds a session request (URL, header multidicts, timers, tracing hooks)
and every network read runs several Python calls of its stream machinery; a token stream is
one read per token. Here a read is one ``data_received`` and one parser callback, and a request
is one pre-built write. What it does not do: redirects (a replica is never followed elsewhere),
cookies, proxies, compression (it asks for none), HTTP upgrades.

Limits: at most ``limit`` requests at once (others wait for a slot), response headers of at most
64 KiB, and a body read no faster than it is consumed: above 256 KiB buffered the connection
stops reading (TCP back-pressure reaches the replica). A response not read to its end, or
aborted, closes its connection, which is how the replica learns that the client went away.

Example::

    pool = ConnectionPool("http://127.0.0.1:8001", name="sim-0")
    async with pool.request("POST", "/v1/chat/completions", body, {"X-Request-Id": "r1"}) as resp:
        if resp.status == 200:
            async for piece in resp.iter_chunks():
                ...
    await pool.close()
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import cast
from urllib.parse import urlsplit

import httptools

from replicas.errors import ReplicaStreamError, ReplicaTimeout, ReplicaUnavailable

__all__ = ["ConnectionPool", "LeanResponse"]

_MAX_HEADER_BYTES = 64 * 1024
_HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.wait_started = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.header_bytes = 0
        self.headers_done = False
        self.keep_alive = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self.headers_done and not self.complete and self._until_eof():
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        if not self.complete:
            self.fail(exc or ConnectionResetError("the replica closed the connection"))

    def _until_eof(self) -> bool:
        h = self.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > _MAX_HEADER_BYTES:
            raise ValueError("response headers over 64 KiB")  # feed_data turns it into an error
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # reset once the message completes
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the request's side ------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def close(self) -> None:
        self.closed = True
        self.stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.transport.write(data)

    def take(self) -> bytes:
        """Everything received and not yet taken (resumes reading if it was paused)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout: float | None) -> None:
        """Until the parser reports progress, the connection fails, or ``timeout`` passes.

        One timer serves many waits (a token stream waits once per token): when it fires
        during a younger wait it is set again for that wait's remaining time."""
        waiter = self.waiter = self.loop.create_future()
        self.wait_started = self.loop.time()
        if timeout is not None and self.timer is None:
            self.timer = self.loop.call_later(timeout, self._check_timeout, timeout)
        try:
            await waiter
        finally:
            self.waiter = None

    def _check_timeout(self, timeout: float) -> None:
        self.timer = None
        if self.waiter is None:
            return  # nobody waits now; the next wait sets the timer again
        left = self.wait_started + timeout - self.loop.time()
        if left > 0:
            self.timer = self.loop.call_later(left, self._check_timeout, timeout)
            return
        self.fail(TimeoutError("no data from the replica within the read timeout"))
        self.close()

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class LeanResponse:
    """A response being received: ``status``, ``headers`` (lower-case names) and the body."""

    def __init__(self, conn: _Connection, replica: str, read_timeout: float | None) -> None:
        self._conn = conn
        self.replica = replica
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers
        self._read_timeout = read_timeout
        self.aborted = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in whatever pieces the network delivers."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise ReplicaStreamError(f"stream from replica broke: {conn.error!r}", replica=self.replica)
            else:
                await conn.wait(self._read_timeout)

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            elif conn.complete:
                return b"".join(parts)
            elif conn.error is not None:
                raise ReplicaUnavailable(f"reading the reply failed: {conn.error!r}", replica=self.replica)
            else:
                await conn.wait(self._read_timeout)

    def abort(self) -> None:
        """Close the connection now: a reader of :meth:`iter_chunks` gets a
        :class:`~replicas.errors.ReplicaStreamError` and the replica sees the client go away."""
        self.aborted = True
        self._conn.fail(ConnectionAbortedError("aborted"))
        self._conn.close()


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to the origin of ``base_url`` (``http`` or ``https``).

    **Parameters:** ``limit`` -- most requests at once; ``keepalive_s`` -- how long an idle
    connection is kept; ``connect_timeout``; ``read_timeout`` -- bounds the wait for the response
    headers and for each piece of the body, not the whole stream; ``headers`` -- sent with every
    request (e.g. ``Authorization``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        limit: int = 512,
        keepalive_s: float = 4.0,
        connect_timeout: float = 3.0,
        read_timeout: float | None = 600.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.name = name or base_url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        host = parts.netloc.rpartition("@")[2]  # never send URL credentials in Host
        fixed = {"Host": host, **(headers or {})}
        self._fixed = "".join(f"{_checked(k)}: {_checked(v)}\r\n" for k, v in fixed.items())
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop),
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls else None,
                ),
                self.connect_timeout,
            )
        except TimeoutError as exc:
            raise ReplicaTimeout(
                f"connecting to {self.host}:{self.port} timed out", replica=self.name
            ) from exc
        except OSError as exc:
            raise ReplicaUnavailable(f"connecting failed: {exc!r}", replica=self.name) from exc
        return conn

    @asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[LeanResponse]:
        """Send one request and hold its response open while the caller reads it. Connection
        failures and timeouts before the response headers raise
        :class:`~replicas.errors.ReplicaUnavailable` / :class:`~replicas.errors.ReplicaTimeout`."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        extra = "".join(f"{_checked(k)}: {_checked(v)}\r\n" for k, v in (headers or {}).items())
        head = (
            f"{_checked(method)} {_checked(self.prefix + path)} HTTP/1.1\r\n{self._fixed}{extra}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        await self._slots.acquire()
        conn: _Connection | None = None
        reusable = False
        try:
            conn = await self._connect()
            conn.send(head.encode("latin-1") + body)
            while not conn.headers_done:
                if conn.error is not None:
                    if isinstance(conn.error, TimeoutError):
                        raise ReplicaTimeout(f"{method} {path} timed out", replica=self.name)
                    raise ReplicaUnavailable(f"{method} {path} failed: {conn.error!r}", replica=self.name)
                await conn.wait(self.read_timeout)
            resp = LeanResponse(conn, self.name, self.read_timeout)
            yield resp
            reusable = (
                conn.complete
                and conn.error is None
                and not resp.aborted
                and not conn.closed
                and conn.keep_alive
            )
        finally:
            if conn is not None:
                conn.stop_timer()
                if reusable:
                    conn.idle_since = asyncio.get_running_loop().time()
                    self._idle.append(conn)
                else:
                    conn.close()
            self._slots.release()

    async def close(self) -> None:
        """Close the idle connections (requests in flight close theirs when they end)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _checked(text: str) -> str:
    """A request line or header part, refused if it could split the request."""
    if "\r" in text or "\n" in text:
        raise ValueError(f"CR or LF in an HTTP request part: {text[:80]!r}")
    return text
