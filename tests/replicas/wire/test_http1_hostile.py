"""The lean HTTP/1.1 pool against a hostile upstream: a raw socket server that writes exactly the
bytes each case scripts (interim responses, CR/CRLF framing, stray bytes, trickling and oversized
bodies, a 101, a malformed chunk size, HEAD, a connection closed under a reused request)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from tidal.replicas.errors import ReplicaStreamError, ReplicaUnavailable
from tidal.replicas.wire.http1 import ConnectionPool, HeaderError
from tidal.replicas.wire.sse import SSEDecoder

pytestmark = pytest.mark.anyio


@dataclass
class Request:
    head: bytes
    body: bytes
    number: int  # 0 for the first request on its connection

    @property
    def rid(self) -> str:
        m = re.search(rb"x-request-id: (\S+)", self.head, re.I)
        return m.group(1).decode() if m else ""


Script = Callable[[Request, asyncio.StreamWriter], Awaitable[bool]]  # False: close the connection


@dataclass
class Upstream:
    url: str
    connections: int = 0
    requests: list[Request] = field(default_factory=list)


@asynccontextmanager
async def hostile(script: Script) -> AsyncIterator[Upstream]:
    upstream = Upstream("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream.connections += 1
        number = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"content-length: (\d+)", head, re.I)
                body = await reader.readexactly(int(m.group(1))) if m else b""
                req = Request(head, body, number)
                upstream.requests.append(req)
                number += 1
                if not await script(req, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream.url = f"http://127.0.0.1:{port}"
    try:
        yield upstream
    finally:
        server.close()


def _response(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _get(pool: ConnectionPool, rid: str = "r") -> tuple[int, bytes]:
    async with pool.request("POST", "/v1/x", b"{}", {"X-Request-Id": rid}) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize(
    "interim",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"],
)
async def test_interim_responses_are_skipped_and_every_answer_reaches_its_own_request(interim: bytes) -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(interim)
        await w.drain()
        await asyncio.sleep(0.001)
        w.write(_response(req.rid.encode(), extra=b"Link: </b>\r\n"))
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        results = await asyncio.gather(*(_get(pool, f"req-{i}") for i in range(64)))
        assert results == [(200, f"req-{i}".encode()) for i in range(64)]
        again = await asyncio.gather(*(_get(pool, f"again-{i}") for i in range(64)))
        assert again == [(200, f"again-{i}".encode()) for i in range(64)]
        assert up.connections <= 64  # the connections were reused, in a clean state
        await pool.close()


async def test_a_101_fails_the_request_and_closes_the_connection() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        w.write(b"\x81\x05hello")
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        with pytest.raises(ReplicaUnavailable, match="101"):
            await _get(pool)
        assert pool._idle == []


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
async def test_sse_streams_piece_by_piece_whatever_the_line_ends(eol: bytes) -> None:
    """The replica writes its second event only after the client has decoded the first: if the
    pool buffered the body, the test would stall (and time out) instead of passing."""
    seen_first = asyncio.Event()

    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(_chunk(b'data: {"n": 1}' + eol + eol))
        await w.drain()
        await asyncio.wait_for(seen_first.wait(), 5)
        w.write(_chunk(b": ping" + eol + b'data: {"n": 2}' + eol + eol + b"data: [DONE]" + eol + eol))
        w.write(b"0\r\n\r\n")
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url, read_timeout=5)
        decoder = SSEDecoder()
        data: list[bytes] = []
        async with pool.request("POST", "/v1/x", b"{}") as resp:
            async for piece in resp.iter_chunks():
                for event in decoder.feed(piece):
                    data.append(event.data)
                    seen_first.set()
        assert data == [b'{"n": 1}', b'{"n": 2}', b"[DONE]"]


async def test_stray_bytes_on_an_idle_connection_never_become_an_answer() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(req.rid.encode()))
        if req.rid == "first":
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(_response(b"stray"))  # an answer to no request
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        assert await _get(pool, "first") == (200, b"first")
        await asyncio.sleep(0.2)  # the stray answer lands while the connection is idle
        assert await _get(pool, "second") == (200, b"second")
        assert up.connections == 2


async def test_a_second_response_glued_to_the_first_is_dropped_with_its_connection() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(req.rid.encode()) + (_response(b"stray") if req.rid == "first" else b""))
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        assert await _get(pool, "first") == (200, b"first")
        assert await _get(pool, "second") == (200, b"second")
        assert up.connections == 2


async def test_a_trickling_body_is_read_whole() -> None:
    body = b'{"answer": "slow"}'

    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for i in range(len(body)):
            w.write(body[i : i + 1])
            await w.drain()
            await asyncio.sleep(0.005)
        return True

    async with hostile(script) as up:
        assert await _get(ConnectionPool(up.url, read_timeout=2)) == (200, body)


async def test_an_oversized_body_is_refused_and_its_connection_closed() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(b"x" * 300_000))
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url, max_body_bytes=100_000)
        with pytest.raises(ReplicaUnavailable, match="over 100000 bytes"):
            await _get(pool)
        assert pool._idle == []


async def test_a_malformed_chunk_size_breaks_the_stream() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + _chunk(b"data: 1\n\n")
            + b"zz\r\nxx\r\n"
        )
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        pieces: list[bytes] = []
        with pytest.raises(ReplicaStreamError):
            async with pool.request("POST", "/v1/x", b"{}") as resp:
                async for piece in resp.iter_chunks():
                    pieces.append(piece)
        assert pieces == [b"data: 1\n\n"]
        assert pool._idle == []


async def test_head_has_no_body_whatever_its_content_length() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url, read_timeout=1)
        async with pool.request("HEAD", "/health") as resp:
            assert resp.status == 200
            assert resp.headers["content-length"] == "1234"
            assert await resp.read() == b""


async def test_a_reused_connection_closed_under_the_request_is_retried_once_on_a_new_one() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        if req.number == 1:
            return False  # closes as the second request on this connection arrives, answering none
        w.write(_response(req.rid.encode()))
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        assert await _get(pool, "one") == (200, b"one")
        assert await _get(pool, "two") == (200, b"two")
        assert [r.rid for r in up.requests] == ["one", "two", "two"]
        assert up.connections == 2


async def test_a_connection_the_replica_closed_while_idle_is_not_reused() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(req.rid.encode()))
        return False  # keep-alive announced, connection closed anyway

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        assert await _get(pool, "one") == (200, b"one")
        await asyncio.sleep(0.05)
        assert await _get(pool, "two") == (200, b"two")
        assert [r.rid for r in up.requests] == ["one", "two"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Bad": "a\r\nInjected: 1"},
        {"X-Bad": "a\nb"},
        {"X-Bad": "a\0b"},
        {"Bad Name": "x"},
        {"X-Bad:": "x"},
        {"X-Bad": "caf\u00e9 \u2603"},
    ],
)
async def test_headers_http_cannot_carry_are_refused_before_sending(headers: dict[str, str]) -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(b"{}"))
        return True

    async with hostile(script) as up:
        pool = ConnectionPool(up.url)
        with pytest.raises(HeaderError):
            async with pool.request("POST", "/v1/x", b"{}", headers):
                pass
        assert up.requests == []
        assert await _get(pool) == (200, b"{}")  # the pool is intact


async def test_a_latin1_header_value_goes_through() -> None:
    async def script(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(_response(req.head.split(b"x-note: ")[1].split(b"\r\n")[0]))
        return True

    async with (
        hostile(script) as up,
        ConnectionPool(up.url).request("POST", "/", b"", {"x-note": "caf\u00e9"}) as resp,
    ):
        assert await resp.read() == "caf\u00e9".encode("latin-1")
