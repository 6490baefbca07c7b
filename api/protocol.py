"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with deadlines on every
request's head and body and on a client's reading of its response, and a size bound on the head.

uvicorn's httptools protocol (the gateway's, for speed) bounds none of them: a connection that
opens and sends nothing stays open, one that sends a header line every few seconds (slowloris),
or headers without end, holds its connection and the memory of what it sent for good (1,000 such
clients are part of ``tidal bench soak``; one client sent 160 MB of headers and the server kept
them all), and so does one that sends its body a byte at a time (the request's task waits on it
for good), or one that stops reading a long response (its stream, and the replica's slot it
holds, wait for good once the buffers are full). Here, as nginx's ``client_header_timeout``,
``large_client_header_buffers`` and ``send_timeout`` and Apache's ``mod_reqtimeout``
(``body=20,MinRate=500``) do:

* **a head deadline**: a request's head (request line and headers) must be complete within
  ``head_timeout_s`` of the connection opening, or of the request's first byte on a kept-alive
  connection; else the gateway answers 408 (when part of a head came) and closes. Between
  requests uvicorn's own keep-alive timeout applies. While a response is still being written
  (a pipelined head waiting behind it) the deadline waits for it;
* **a head size bound**: the URL and the header names and values of one head may hold at most
  ``max_head_bytes``; more is answered 431 and the connection closed, before the rest is read;
* **a body deadline**: a request's body must be complete within ``body_timeout_s`` of its head,
  plus one second for every ``body_min_bytes_per_s`` bytes that came (a large upload at a steady
  pace is served however long it takes; a trickle is not); else 408 when no response has
  started (the application's wait for the body ends as for a client that went away), and the
  connection closed. Time the server itself stops reading does not count: while the
  application has not taken what came (uvicorn pauses reading past 64 KiB unread), a pipelined
  request waits behind another, or a ``100-continue`` has not been sent, the deadline restarts;
* **a send deadline**: when what the gateway writes to a client has piled up past the
  transport's high-water mark (the kernel's buffers full: the client is not reading) and stays
  there for ``send_timeout_s``, the connection is aborted; the application sees the client go
  away (a stream ends and frees its replica's slot). A client that reads, however slowly, drains
  the pile and restarts the clock.

The body's size is the application's to bound (:class:`~api.limits.BodyLimit`).

Every connection a bound ends is counted in :data:`CUTS` by reason (``head_too_large``,
``head_timeout``, ``idle``: a new connection that sent nothing, ``body_timeout``,
``send_timeout``), and so is one that sent what is not HTTP (``bad_request``: uvicorn answers 400
and closes); the gateway exports the counts as ``tidal_gateway_connections_cut_total``.
One process serves one server, so the tally is the process's. uvicorn also logs a warning for
each request it cannot parse, so a client sending garbage would write the log as fast as it
sends: :class:`InvalidRequestLog` lets one of those lines through a minute, with the number held
back.

Example::

    bounds = RequestBounds(max_head_bytes=65536, head_timeout_s=10.0, body_timeout_s=20.0,
                           body_min_bytes_per_s=500, send_timeout_s=60.0)
    uvicorn.run(app, http=bounded_protocol(bounds))
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

__all__ = [
    "CUTS",
    "CUT_REASONS",
    "BodyWriter",
    "BoundedProtocol",
    "InvalidRequestLog",
    "RequestBounds",
    "bounded_protocol",
]

CUT_REASONS = ("head_too_large", "head_timeout", "idle", "body_timeout", "send_timeout", "bad_request")
CUTS: Counter[str] = Counter()  # connections the bounds ended in this process, by reason


@dataclass(frozen=True)
class RequestBounds:
    """The bounds of :class:`BoundedProtocol` (the fleet file's ``gateway`` section)."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 10.0
    body_timeout_s: float = 20.0
    body_min_bytes_per_s: int = 500
    send_timeout_s: float = 60.0


class BodyWriter:
    """``scope["tidal.write"]``: writes a piece of a started, chunked response body at once,
    without a coroutine -- what the streaming proxy calls from the replica connection's read
    callback (:meth:`~replicas.wire.http1.LeanResponse.relay`), so that a token costs no task
    switch. Returns ``None``, or an awaitable when the client's buffers are full (done when they
    drain). A client that went away swallows the write, as the server's ``send`` does. The
    response starts and ends through ``send``.

    The writer is in the cycle's scope, so it holds the cycle weakly: a reference cycle would
    leave every request's scope and server cycle to the garbage collector (whose passes
    stall a busy gateway's loop) instead of freeing them when the request ends."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def __call__(self, body: bytes) -> Coroutine[Any, Any, None] | None:
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or not body:
            return None  # (an empty chunk would end the response)
        if not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
            raise RuntimeError("tidal.write needs a started, chunked response that has not ended")
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return cycle.flow.drain() if cycle.flow.write_paused else None


class _HeadTooLarge(Exception):
    """Raised from a parser callback: stops the parse (uvicorn then answers, see
    :meth:`BoundedProtocol.send_400_response`)."""


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the bound of :attr:`bounds` (a class
    attribute: uvicorn builds one instance per connection; see :func:`bounded_protocol`)."""

    bounds: ClassVar[RequestBounds] = RequestBounds()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # of the head being read
        self._head_started = False  # whether a byte of the current head has come
        self._head_timer: asyncio.TimerHandle | None = None
        self._too_large = False  # the parse stopped at the bound: 431, not uvicorn's 400
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due = 0.0  # loop time the body is due by, before what came extends it
        self._body_bytes = 0  # of the body being read
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's head is due too

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._body_timer = _cancelled(self._body_timer)
        self._send_timer = _cancelled(self._send_timer)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.bounds.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._send_timer = _cancelled(self._send_timer)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._head_started = True
        if self._head_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._head_started = False
        super().on_headers_complete()
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            # (a request without a body completes in the same parse: the timer goes at once)
            _cancelled(self._body_timer)
            self._body_bytes = 0
            self._body_due = self.loop.time() + self.bounds.body_timeout_s
            self._body_timer = self.loop.call_later(self.bounds.body_timeout_s, self._body_timeout)
        if self.cycle is not None and self.cycle.scope is self.scope:  # (not an upgrade)
            self.scope["tidal.write"] = BodyWriter(self.cycle)  # type: ignore[typeddict-unknown-key]

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_timer = _cancelled(self._body_timer)
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parse error; a head over the bound stopped the parse with one,
        and gets its own status instead."""
        if self._too_large:
            CUTS["head_too_large"] += 1
            self._refuse(431)
        else:
            CUTS["bad_request"] += 1
            super().send_400_response(msg)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.bounds.max_head_bytes:
            self._too_large = True
            raise _HeadTooLarge

    def _arm(self) -> None:
        _cancelled(self._head_timer)
        self._head_timer = self.loop.call_later(self.bounds.head_timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # a response is being written: the head behind it waits for it
            return
        if self._head_started:
            CUTS["head_timeout"] += 1
            self._refuse(408)
        else:
            CUTS["idle"] += 1
            self.transport.close()  # nothing came: nothing to answer

    def _body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        now, b = self.loop.time(), self.bounds
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # The server is not reading (the application has not taken what came, or has not
            # asked for the body yet; a pipelined request waits): the client is not late.
            self._body_due = now + b.body_timeout_s - self._body_bytes / b.body_min_bytes_per_s
        due = self._body_due + self._body_bytes / b.body_min_bytes_per_s
        if now < due:
            self._body_timer = self.loop.call_later(due - now, self._body_timeout)
            return
        CUTS["body_timeout"] += 1
        if not cycle.response_started:
            self._refuse(408)
        else:
            self.transport.close()

    def _send_timeout(self) -> None:
        """The client has taken nothing for ``send_timeout_s``: drop the connection and what is
        buffered for it (a close would wait to flush it, and a closing transport that the client
        does not read stays open as long)."""
        self._send_timer = None
        CUTS["send_timeout"] += 1
        self.transport.abort()

    def _refuse(self, status: int) -> None:
        """Answer ``status`` with ``Connection: close`` and close (what is left unread is not)."""
        body = HTTPStatus(status).phrase.encode() + b"\n"
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if there is one; returns ``None``, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


class InvalidRequestLog(logging.Filter):
    """On uvicorn's ``uvicorn.error`` logger: of its warning for each request it cannot parse
    ("Invalid HTTP request received."), the first goes through, then one every ``every_s``
    saying how many were held back since; every other line goes through as it is. (The requests
    themselves are counted, as ``bad_request`` or ``head_too_large`` cuts.)"""

    MESSAGE = "Invalid HTTP request received."

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._next = -math.inf
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE:
            return True
        now = self.clock()
        if now < self._next:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{self.MESSAGE} ({self._held} more held back since the last of these lines)"
            self._held = 0
        self._next = now + self.every_s
        return True


def bounded_protocol(bounds: RequestBounds) -> type[BoundedProtocol]:
    """A :class:`BoundedProtocol` with these bounds, for ``uvicorn.Config(http=...)``; puts an
    :class:`InvalidRequestLog` on uvicorn's logger (one a process)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, InvalidRequestLog) for f in logger.filters):
        logger.addFilter(InvalidRequestLog())
    return type("BoundedProtocol", (BoundedProtocol,), {"bounds": bounds, "__module__": __name__})
