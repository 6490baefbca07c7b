"""A lean HTTP/1.1 client for the gateway's streaming proxy: keep-alive connections to one origin
on asyncio protocols, responses parsed by ``httptools`` (the C parser uvicorn uses).

The proxy sends one request per stream and forwards the replica's bytes as they come. Through
aiohttp each request builds a session request (URL, header multidicts, timers, tracing hooks)
and every network read runs several Python calls of its stream machinery; a token stream is
one read per token. Here a read is one ``data_received`` and one parser callback, and a request
is one pre-built write. What it does not do: redirects (a replica is never followed elsewhere),
cookies, proxies, compression (it asks for none), HTTP upgrades.

Limits: at most ``limit`` requests at once (others wait for a slot), response headers of at most
64 KiB, a whole-body :meth:`LeanResponse.read` of at most ``max_body_bytes``, and a body read no
faster than it is consumed: above 256 KiB buffered the connection stops reading (TCP
back-pressure reaches the replica). A response not read to its end, or aborted, closes its
connection, which is how the replica learns that the client went away.

Protocol rules it keeps, so that an answer can never reach another request:

* a fresh parser per request, and per-message state reset at each message's begin;
* interim ``1xx`` responses (``100 Continue``, ``103 Early Hints``) are skipped; ``101`` (a switch
  of protocols nobody asked for) fails the request and closes the connection;
* a connection goes back to the pool only after its response ended cleanly with keep-alive;
  bytes that arrive while it is idle (a stray or late response) or its end close it, and a
  connection is checked for pending bytes or EOF again when it is taken from the pool;
* a request on a reused connection that fails before any response byte (the replica closed the
  idle connection as the request went out) is sent once more on a new connection;
* the answer to ``HEAD`` has no body, whatever its ``Content-Length`` says (and the connection is
  not reused: the parser cannot be told to skip a body);
* request lines and headers are checked: names are tokens, values hold no CR, LF or NUL, both
  are Latin-1 (:class:`HeaderError`, a ``ValueError``, before anything is sent).

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
import inspect
import re
import select
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import cast
from urllib.parse import urlsplit

import httptools

from tidal.replicas.errors import ReplicaStreamError, ReplicaTimeout, ReplicaUnavailable

__all__ = ["ConnectionPool", "HeaderError", "LeanResponse", "check_header"]

_MAX_HEADER_BYTES = 64 * 1024
_HIGH_WATER = 256 * 1024
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class HeaderError(ValueError):
    """A request line or header that HTTP/1.1 cannot carry as it stands."""


class _Stray(Exception):
    """A second response on one request, or bytes on an idle connection."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses the response of one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.wait_started = 0.0
        self.in_use = False  # a request is out and its response not yet ended
        self.head = False  # the request is a HEAD: its answer has no body
        self.received = 0  # response bytes of the current request
        self.interim = False  # parsing a 1xx response, which is skipped
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
        self.refused: Exception | None = None  # why a callback stopped the parser
        self.sink: Callable[[bytes], Awaitable[None] | None] | None = None  # see LeanResponse.relay
        self.blocked: Awaitable[None] | None = None  # the sink is full until this is done

    def _refuse(self, exc: Exception) -> Exception:
        """``exc``, kept: httptools reports a callback's exception only as "callback error"."""
        self.refused = exc
        return exc

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.in_use:
            self.close()  # bytes nobody asked for: never let them become an answer
            return
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(self.refused or exc)
            self.close()
        if self.sink is not None and self.chunks:
            self._deliver(self.sink)

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

    def on_message_begin(self) -> None:
        if self.complete or self.headers_done:
            raise self._refuse(_Stray("a second response to one request"))
        self.status = 0
        self.headers = {}
        self.header_bytes = 0
        self.interim = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > _MAX_HEADER_BYTES:
            raise self._refuse(ValueError("response headers over 64 KiB"))
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101:
            raise self._refuse(
                ConnectionError("the replica switched protocols (HTTP 101), which is not supported")
            )
        if 100 <= status < 200:
            self.interim = True  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.head:
            self.complete = True
            self.keep_alive = False
            self._wake()
        # Else the request waits on for the body's first piece (or its end): a stream's headers
        # come ahead of its first token, and waking for them alone costs a turn of the loop.

    def on_body(self, body: bytes) -> None:
        if self.complete:
            raise self._refuse(_Stray("a body after the response ended"))
        self.chunks.append(body)
        if self.sink is not None:
            return  # delivered once the read is parsed, without waking the reader
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER:
            self.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.complete:
            return  # the end of a HEAD answer's announced body, already ended
        self.complete = True
        self.in_use = False
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

    def send(self, data: bytes, head: bool = False) -> None:
        """Write one request; the response state starts afresh, with a new parser."""
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.in_use = True
        self.head = head
        self.received = 0
        self.interim = False
        self.status = 0
        self.headers = {}
        self.header_bytes = 0
        self.headers_done = False
        self.keep_alive = False
        self.chunks = []
        self.buffered = 0
        self.complete = False
        self.error = None
        self.sink = None
        self.blocked = None
        self.transport.write(data)

    def answered(self) -> bool:
        """Whether the response is there to hand over: its headers and the body's first piece
        (or its end, or a failure after the headers)."""
        return self.headers_done and bool(self.chunks or self.complete or self.error is not None)

    def pending(self) -> bool:
        """Whether the socket has bytes or an EOF waiting (an idle connection must have none)."""
        if self.closed or self.transport is None:
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))

    def take(self) -> bytes:
        """Everything received and not yet taken (resumes reading if it was paused)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        self.resume_reading()
        return data

    def pause_reading(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _deliver(self, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Hand what one read brought (or what was buffered before the relay began) to
        ``sink``; reading pauses while the sink is full."""
        data = self.take()
        self.wait_started = self.loop.time()  # the read timeout counts from the latest piece
        try:
            blocked = sink(data)
        except Exception as exc:  # the reader raises it
            self.fail(exc)
            self.close()
            return
        if blocked is not None:
            self.blocked = blocked
            self.pause_reading()
            self._wake()

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

    def __init__(
        self, conn: _Connection, replica: str, read_timeout: float | None, max_body_bytes: int
    ) -> None:
        self._conn = conn
        self.replica = replica
        self.max_body_bytes = max_body_bytes
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

    async def relay(self, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Hand the body to ``sink`` as it arrives, until it ends.

        ``sink`` is called from the connection's own read callback, once per network read, so a
        token stream costs no task switch per token; it must not raise (what it raises fails
        the relay and closes the connection). It returns ``None``, or an awaitable when its
        consumer is full: reading pauses until that is done (TCP back-pressure reaches the
        replica). Ends and fails as :meth:`iter_chunks` does; ``read_timeout`` bounds the wait
        for each piece."""
        conn = self._conn
        conn.sink = sink
        try:
            while True:
                if conn.chunks:
                    conn._deliver(sink)
                elif conn.blocked is not None:
                    blocked, conn.blocked = conn.blocked, None
                    await blocked
                    conn.resume_reading()
                elif conn.complete:
                    return
                elif conn.error is not None:
                    raise ReplicaStreamError(
                        f"stream from replica broke: {conn.error!r}", replica=self.replica
                    )
                else:
                    await conn.wait(self._read_timeout)
        finally:
            conn.sink = None
            pending, conn.blocked = conn.blocked, None
            if inspect.iscoroutine(pending):
                pending.close()  # never awaited: the relay ended first

    async def read(self) -> bytes:
        """The whole body, at most ``max_body_bytes`` of it (more aborts the response and raises
        :class:`~replicas.errors.ReplicaUnavailable`)."""
        conn = self._conn
        parts: list[bytes] = []
        size = 0
        while True:
            if conn.chunks:
                part = conn.take()
                size += len(part)
                if size > self.max_body_bytes:
                    self.abort()
                    raise ReplicaUnavailable(
                        f"the reply is over {self.max_body_bytes} bytes", replica=self.replica
                    )
                parts.append(part)
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
    request (e.g. ``Authorization``); ``max_body_bytes`` -- the most :meth:`LeanResponse.read`
    takes.
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
        max_body_bytes: int = 64 * 1024 * 1024,
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
        self.max_body_bytes = max_body_bytes
        host = parts.netloc.rpartition("@")[2]  # never send URL credentials in Host
        fixed = {"Host": host, **(headers or {})}
        self._fixed = _header_lines(fixed)
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None

    async def _connect(self, fresh: bool = False) -> tuple[_Connection, bool]:
        """A connection to send on (a new one if ``fresh``), and whether it was reused."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle and not fresh:
            conn = self._idle.pop()
            if now - conn.idle_since < self.keepalive_s and not conn.pending():
                return conn, True
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
        return conn, False

    @asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[LeanResponse]:
        """Send one request and hold its response open while the caller reads it. Connection
        failures and timeouts before the response headers raise
        :class:`~replicas.errors.ReplicaUnavailable` / :class:`~replicas.errors.ReplicaTimeout`;
        a request line or header HTTP cannot carry raises :class:`HeaderError` (nothing sent)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        head = (
            f"{_token(method)} {_target(self.prefix + path)} HTTP/1.1\r\n{self._fixed}"
            f"{_header_lines(headers) if headers else ''}Content-Length: {len(body)}\r\n\r\n"
        )
        data = _latin1(head) + body
        is_head = method == "HEAD"
        await self._slots.acquire()
        conn: _Connection | None = None
        reusable = False
        try:
            conn, reused = await self._connect()
            conn.send(data, is_head)
            while not conn.answered():
                if conn.error is not None and not conn.headers_done:
                    if reused and conn.received == 0 and not isinstance(conn.error, TimeoutError):
                        # The replica closed the idle connection as the request went out: no
                        # byte of an answer came, so the request goes once more, on a new one.
                        conn.close()
                        conn, reused = await self._connect(fresh=True)
                        conn.send(data, is_head)
                        continue
                    if isinstance(conn.error, TimeoutError):
                        raise ReplicaTimeout(f"{method} {path} timed out", replica=self.name)
                    raise ReplicaUnavailable(f"{method} {path} failed: {conn.error!r}", replica=self.name)
                await conn.wait(self.read_timeout)
            resp = LeanResponse(conn, self.name, self.read_timeout, self.max_body_bytes)
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


def _latin1(text: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise HeaderError(f"a request line or header that is not Latin-1: {text[:80]!r}") from exc


def _token(name: str) -> str:
    if not _TOKEN.fullmatch(name):
        raise HeaderError(f"not an HTTP token: {name[:80]!r}")
    return name


def _target(path: str) -> str:
    if not path.startswith("/") or any(c in path for c in " \r\n\0\t"):
        raise HeaderError(f"not a request target: {path[:80]!r}")
    return path


def check_header(name: str, value: str) -> None:
    """Refuse a header whose name is not a token, or whose value could split the request (CR,
    LF), is cut short by C parsers (NUL) or is not Latin-1."""
    _token(name)
    if "\r" in value or "\n" in value or "\0" in value:
        raise HeaderError(f"CR, LF or NUL in the value of header {name[:80]!r}")
    _latin1(value)


def _header_lines(headers: Mapping[str, str]) -> str:
    for name, value in headers.items():
        check_header(name, value)
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items())
