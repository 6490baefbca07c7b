"""The gateway's server protocol bounds a request's head: its size (431) and how long it may take
to arrive (408; an idle new connection is closed), over real sockets against uvicorn -- and
nothing else: kept-alive connections, long streamed responses and pipelined requests are served
as before. The last test runs ``tidal gateway`` itself with a fleet file's bounds."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
import yaml

from tests.api.harness import fleet_dict
from tidal.api.protocol import head_limited_protocol
from tidal.replicas.launcher import ReplicaProcess, free_port

TIMEOUT_S = 0.6
MAX_HEAD = 4096


async def _app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    """``/stream?n``: n pieces 0.1 s apart; anything else: ``ok``."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})  # type: ignore[operator]
    if scope["path"] == "/stream":
        for _ in range(int(scope["query_string"] or 1)):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})  # type: ignore[operator]
            await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    protocol = head_limited_protocol(max_head_bytes=MAX_HEAD, head_timeout_s=TIMEOUT_S)
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=port, loop="asyncio", http=protocol, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5.0)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (a timeout fails the test)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


_END = b"ok\r\n0\r\n\r\n"  # a response's end (chunked: the app gives no length; its last piece is ``ok``)
_unread: dict[int, bytes] = {}  # per socket: what was read past the last response returned


def _response(s: socket.socket) -> bytes:
    """The next response on ``s`` (pipelined ones may arrive in one read)."""
    out = _unread.pop(s.fileno(), b"")
    while _END not in out:
        chunk = s.recv(65536)
        assert chunk, out
        out += chunk
    end = out.index(_END) + len(_END)
    _unread[s.fileno()] = out[end:]
    return out[:end]


def _get(path: str = "/", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + extra + b"\r\n"


def test_a_head_over_the_bound_is_answered_431_and_closed(port: int) -> None:
    with _connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: gw\r\n")
        with pytest.raises((ConnectionError, OSError)):  # sent until the server shuts the connection
            for _ in range(1000):
                s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
                time.sleep(0.001)
            s.recv(1)  # (a server that kept reading: no 431 below either)
    with _connect(port) as s:
        s.sendall(_get(extra=b"X-Pad: " + b"a" * (MAX_HEAD + 10) + b"\r\n"))
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"connection: close" in reply.lower()
    # A head within the bound is served.
    with _connect(port) as s:
        s.sendall(_get(extra=b"X-Pad: " + b"a" * (MAX_HEAD - 200) + b"\r\n"))
        assert _response(s).startswith(b"HTTP/1.1 200 ")


def test_a_head_that_does_not_arrive_in_time_is_answered_408_and_closed(port: int) -> None:
    with _connect(port) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        for k in range(20):  # a header line every 0.1 s, never the blank line
            try:
                s.sendall(f"X-Slow-{k}: {k}\r\n".encode())
            except OSError:
                break
            time.sleep(0.1)
        reply = _read_all(s)
        took = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    # (from the server's accept, a moment before the client's clock starts)
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 2.0


def test_a_new_connection_that_sends_nothing_is_closed_without_a_reply(port: int) -> None:
    with _connect(port) as s:
        t0 = time.monotonic()
        assert _read_all(s) == b""
        assert TIMEOUT_S - 0.1 <= time.monotonic() - t0 < TIMEOUT_S + 2.0


def test_kept_alive_connections_long_streams_and_pipelined_requests_are_served(port: int) -> None:
    with _connect(port) as s:
        # The deadline counts from each request's first byte: a connection older than it that
        # keeps sending whole requests is served (each pause below uvicorn's keep-alive, 5 s).
        for _ in range(4):
            s.sendall(_get())
            assert _response(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(TIMEOUT_S / 2)
        # A response written for longer than the deadline is not cut, nor is a request
        # pipelined behind it (its head complete), nor a part of one waiting behind it.
        s.sendall(_get("/stream?15") + _get())
        first = _response(s)
        assert first.startswith(b"HTTP/1.1 200 ") and first.count(b"x") >= 15
        assert _response(s).startswith(b"HTTP/1.1 200 ")
        s.sendall(_get("/stream?15") + b"GET / HTTP/1.1\r\nHo")
        assert _response(s).count(b"x") >= 15
        time.sleep(0.05)
        s.sendall(b"st: gw\r\n\r\n")
        assert _response(s).startswith(b"HTTP/1.1 200 ")


def test_the_gateway_serves_with_the_fleet_files_bounds(tmp_path: Path) -> None:
    fleet = fleet_dict(["http://127.0.0.1:9"])
    fleet["gateway"].update(max_head_bytes=2048, head_timeout_s=1.0)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    gw_port = free_port()
    proc = ReplicaProcess(
        "gateway",
        [sys.executable, "-m", "tidal", "gateway", "--config", str(path), "--port", str(gw_port)],
        port=gw_port,
        log_path=tmp_path / "gateway.log",
        health_path="/healthz",
    )
    proc.start()
    try:
        proc.wait_ready(60)
        with _connect(gw_port) as s:
            s.sendall(_get("/healthz"))
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        with _connect(gw_port) as s:
            s.sendall(_get("/healthz", b"X-Pad: " + b"a" * 3000 + b"\r\n"))
            assert _read_all(s).startswith(b"HTTP/1.1 431 ")
        with _connect(gw_port) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n")
            assert _read_all(s).startswith(b"HTTP/1.1 408 ")
            assert 0.9 <= time.monotonic() - t0 < 4.0
    finally:
        proc.stop()
