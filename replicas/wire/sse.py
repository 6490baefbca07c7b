"""Server-Sent Events: one incremental decoder, following the WHATWG event-stream rules.

Bytes go in as the network delivers them; whole events come out. Lines end with LF, CRLF or a
lone CR (a CRLF split across two pieces is one line end); ``data:`` lines of one event are joined
with LF; a line starting with ``:`` is a comment; ``event``, ``id`` (ignored when it holds NUL)
and ``retry`` (digits only) are kept; unknown fields are ignored; one space after the colon is
dropped; a leading byte-order mark is skipped; an event is dispatched at a blank line and only
when it had a ``data`` line. Text stays bytes: the payloads are JSON, parsed by the caller.

A line may be at most ``max_line`` bytes (1 MiB by default): a peer that never ends its line
raises :class:`SSEError` instead of growing the buffer without bound.

Example::

    decoder = SSEDecoder()
    for piece in chunks:
        for event in decoder.feed(piece):
            if event.data == b"[DONE]":
                ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

__all__ = ["Event", "SSEDecoder", "SSEError", "iter_data"]

_BOM = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The stream broke a limit (a line longer than ``max_line``)."""


class Event(NamedTuple):
    """One dispatched event: ``data`` (its ``data:`` lines joined by LF), ``event`` (the type,
    ``b"message"`` when none was given), ``id`` (the last event id in force, or ``None``) and
    ``retry`` (milliseconds, when this event carried a valid ``retry`` field)."""

    data: bytes
    event: bytes = b"message"
    id: bytes | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental decoder; :meth:`feed` returns the events completed by that piece."""

    __slots__ = (
        "_buf",
        "_data",
        "_event",
        "_max_line",
        "_retry",
        "_skip_lf",
        "_started",
        "idle",
        "last_id",
        "retry",
    )

    def __init__(self, max_line: int = 1 << 20) -> None:
        self._max_line = max_line
        self._buf = b""
        self._skip_lf = False  # the last piece ended in CR: a leading LF belongs to it
        self._started = False  # past the optional byte-order mark
        self._data: list[bytes] = []
        self._event = b""
        self._retry: int | None = None
        self.last_id: bytes | None = None  # the last event id, kept across events
        self.retry: int | None = None  # the reconnection time the stream asked for, in ms
        # Past the byte-order mark with no partial line or event pending: the next byte starts
        # a new event (kept up to date by feed, so a reader's check is one attribute).
        self.idle = False

    def feed(self, piece: bytes) -> list[Event]:
        if not piece:
            return []
        if (  # the common case, one whole single-line event with nothing pending: no split
            piece[-2:] == b"\n\n"
            and piece[:6] == b"data: "
            and not self._buf
            and not self._data
            and not self._skip_lf
            and not self._event
            and self._retry is None
            and self._started
            and piece.find(b"\n") == len(piece) - 2
            and b"\r" not in piece
        ):
            return [Event(piece[6:-2], b"message", self.last_id)]
        if self._skip_lf:
            self._skip_lf = False
            if piece[:1] == b"\n":
                piece = piece[1:]
        buf = self._buf + piece if self._buf else piece
        if not self._started:
            if len(buf) < 3 and _BOM.startswith(buf):
                self._buf = buf
                return []
            self._started = True
            if buf.startswith(_BOM):
                buf = buf[3:]
        if b"\r" in buf:
            if buf[-1:] == b"\r":
                self._skip_lf = True
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = buf.split(b"\n")
        if len(rest) > self._max_line:
            raise SSEError(f"an SSE line longer than {self._max_line} bytes")
        self._buf = rest
        events: list[Event] = []
        data = self._data
        for line in lines:
            if line[:5] == b"data:":  # the common case, inline
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line:
                self._field(line)
            elif data:
                events.append(Event(b"\n".join(data), self._event or b"message", self.last_id, self._retry))
                data = self._data = []
                self._event = b""
                self._retry = None
            else:  # a blank line with no data: nothing to dispatch
                self._event = b""
                self._retry = None
        self.idle = not rest and not data and not self._skip_lf and not self._event and self._retry is None
        return events

    def _reset(self) -> None:
        self._data = []
        self._event = b""
        self._retry = None

    def _field(self, line: bytes) -> None:
        if line[0] == 0x3A:  # ":" -- a comment
            return
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value
        elif name == b"id":
            if b"\0" not in value:
                self.last_id = value
        elif name == b"retry" and value.isdigit():
            self._retry = self.retry = int(value)


async def iter_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data`` of each event of a byte stream, until ``[DONE]`` (OpenAI's end marker)."""
    decoder = SSEDecoder()
    async for piece in chunks:
        for event in decoder.feed(piece):
            if event.data == b"[DONE]":
                return
            yield event.data
