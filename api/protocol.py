"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with a deadline and a
size bound on every request's head.

uvicorn's httptools protocol (the gateway's, for speed) bounds neither: a connection that opens
and sends nothing stays open, and one that sends a header line every few seconds (slowloris), or
headers without end, holds its connection and the memory of what it sent for good (1,000 such
clients are part of ``tidal bench soak``; one client sent 160 MB of headers and the server kept
them all). Here, as nginx's ``client_header_timeout`` and ``large_client_header_buffers`` do:

* **a deadline**: a request's head (request line and headers) must be complete within
  ``head_timeout_s`` of the connection opening, or of the request's first byte on a kept-alive
  connection; else the gateway answers 408 (when part of a head came) and closes. Between
  requests uvicorn's own keep-alive timeout applies. While a response is still being written
  (a pipelined head waiting behind it) the deadline waits for it;
* **a size bound**: the URL and the header names and values of one head may hold at most
  ``max_head_bytes``; more is answered 431 and the connection closed, before the rest is read.

The body is the application's to bound (:class:`~api.limits.BodyLimit`).

Example::

    uvicorn.run(app, http=head_limited_protocol(max_head_bytes=65536, head_timeout_s=10.0))
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["HeadLimitedProtocol", "head_limited_protocol"]


class _HeadTooLarge(Exception):
    """Raised from a parser callback: stops the parse (uvicorn then answers, see
    :meth:`HeadLimitedProtocol.send_400_response`)."""


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :attr:`max_head_bytes` and :attr:`head_timeout_s`
    (class attributes: uvicorn builds one instance per connection; see
    :func:`head_limited_protocol`)."""

    max_head_bytes: ClassVar[int] = 64 * 1024
    head_timeout_s: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # of the head being read
        self._head_started = False  # whether a byte of the current head has come
        self._head_timer: asyncio.TimerHandle | None = None
        self._too_large = False  # the parse stopped at the bound: 431, not uvicorn's 400

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request's head is due too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        self._disarm()
        self._head_started = False
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parse error; a head over the bound stopped the parse with one,
        and gets its own status instead."""
        if self._too_large:
            self._refuse(431)
        else:
            super().send_400_response(msg)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            self._too_large = True
            raise _HeadTooLarge

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # a response is being written: the head behind it waits for it
            return
        if self._head_started:
            self._refuse(408)
        else:
            self.transport.close()  # nothing came: nothing to answer

    def _refuse(self, status: int) -> None:
        """Answer ``status`` with ``Connection: close`` and close (what is left unread is not)."""
        body = HTTPStatus(status).phrase.encode() + b"\n"
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def head_limited_protocol(*, max_head_bytes: int, head_timeout_s: float) -> type[HeadLimitedProtocol]:
    """A :class:`HeadLimitedProtocol` with these bounds, for ``uvicorn.Config(http=...)``."""
    return type(
        "HeadLimitedProtocol",
        (HeadLimitedProtocol,),
        {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s, "__module__": __name__},
    )
