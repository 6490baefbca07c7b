"""The gateway's server protocol bounds a request's head -- its size (431) and how long it may take
to arrive (408; an idle new connection is closed) -- how long its body may take (408), and how
long a client may leave its response unread (aborted), over real sockets against uvicorn; and
nothing else: kept-alive connections, long streamed responses, pipelined requests, a steady
upload longer than the body deadline, bodies the application takes its time to read and a
client that reads a large response slowly are served as before. The last two run ``tidal
gateway`` itself: with a fleet file's bounds, and in front of a simulated replica whose stream a
client stops reading (cut, and aborted upstream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.api.harness import (
    DEV_KEY,
    Gateway,
    fleet_dict,
    run_gateway,
    running as running_process,
    serve_asgi,
)
from tidal.api.protocol import CUT_REASONS, CUTS, InvalidRequestLog, RequestBounds
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process
from tidal.replicas.wire.prom import parse_samples

TIMEOUT_S = 0.6
MAX_HEAD = 4096
BODY_TIMEOUT_S = 0.6
BODY_RATE = 100  # bytes a second that extend the body deadline by a second
LATE_S = 1.5  # how long ``/late`` waits before reading its body
SEND_TIMEOUT_S = 0.6
MIB = 1 << 20
_sent: dict[str, float] = {}  # ``/big?n`` -> when the application's last send returned
_wrote: list[str] = []  # what ``/write``'s calls of ``tidal.write`` returned


async def _app(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
    """``/stream?n``: n pieces 0.1 s apart; ``/big?n``: n MiB at once (when its sends returned is
    kept in ``_sent``); ``/write``: ``a``, an empty piece and ``bc`` through ``tidal.write`` (what
    its calls returned is kept in ``_wrote``); ``/late``: reads its body after ``LATE_S``; anything
    else: ``ok`` (a
    request's body is read first; its length leads the answer)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/late":
        await asyncio.sleep(LATE_S)
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    write = scope.get("tidal.write")
    if scope["path"] == "/write":  # (before the response starts, the writer refuses)
        with contextlib.suppress(RuntimeError):
            write(b"early")
            _wrote.append("early")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/write":
        _wrote.extend(repr(write(piece)) for piece in (b"a", b"", b"bc"))
    if scope["path"] == "/stream":
        for _ in range(int(scope["query_string"] or 1)):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await asyncio.sleep(0.1)
    if scope["path"] == "/big":
        for _ in range(int(scope["query_string"] or 1)):
            await send({"type": "http.response.body", "body": b"y" * MIB, "more_body": True})
        _sent[scope["query_string"].decode()] = time.monotonic()
    await send(
        {"type": "http.response.body", "body": f"{size} ".encode() if size else b"", "more_body": True}
    )
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(bounds: RequestBounds) -> contextlib.AbstractContextManager[int]:
    return serve_asgi(_app, bounds)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with _serve(RequestBounds(MAX_HEAD, TIMEOUT_S, BODY_TIMEOUT_S, BODY_RATE, SEND_TIMEOUT_S)) as port:
        yield port


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


def _post_head(path: str, length: int, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n%s\r\n" % (path.encode(), length, extra)


def _trickle(s: socket.socket, total: int, piece: int, every_s: float) -> None:
    """``total`` body bytes, ``piece`` at a time ``every_s`` apart (until the server closes)."""
    for _ in range(0, total, piece):
        try:
            s.sendall(b"b" * piece)
        except OSError:
            return
        time.sleep(every_s)


@contextlib.contextmanager
def _cuts(**expected: int) -> Iterator[None]:
    """The connections the bounds cut inside the block, by reason: ``expected``, none other."""
    before = dict(CUTS)
    yield
    got = {r: CUTS[r] - before.get(r, 0) for r in CUT_REASONS}
    assert got == {r: expected.get(r, 0) for r in CUT_REASONS}


def test_a_head_over_the_bound_is_answered_431_and_closed(port: int) -> None:
    with _cuts(head_too_large=1), _connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: gw\r\n")
        with pytest.raises((ConnectionError, OSError)):  # sent until the server shuts the connection
            for _ in range(1000):
                s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
                time.sleep(0.001)
            s.recv(1)  # (a server that kept reading: no 431 below either)
    with _cuts(head_too_large=1), _connect(port) as s:
        s.sendall(_get(extra=b"X-Pad: " + b"a" * (MAX_HEAD + 10) + b"\r\n"))
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"connection: close" in reply.lower()
    # A head within the bound is served.
    with _cuts(), _connect(port) as s:
        s.sendall(_get(extra=b"X-Pad: " + b"a" * (MAX_HEAD - 200) + b"\r\n"))
        assert _response(s).startswith(b"HTTP/1.1 200 ")


def test_bytes_that_are_not_http_are_answered_400_counted_and_logged_once_a_minute(port: int) -> None:
    logger = logging.getLogger("uvicorn.error")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with _cuts(bad_request=20):
            for _ in range(20):
                with _connect(port) as s:
                    s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
                    reply = _read_all(s)
                assert reply.startswith(b"HTTP/1.1 400 ") and b"connection: close" in reply.lower()
    finally:
        logger.removeHandler(handler)
    # (one line at most: another test of this module may have had this minute's)
    assert len([line for line in lines if "Invalid HTTP request" in line]) <= 1, lines


def test_uvicorns_warning_per_unparsable_request_goes_through_once_a_minute() -> None:
    now = [0.0]
    quiet = InvalidRequestLog(every_s=60.0, clock=lambda: now[0])

    def passes(msg: str) -> str | None:
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)
        return record.getMessage() if quiet.filter(record) else None

    assert passes(InvalidRequestLog.MESSAGE) == InvalidRequestLog.MESSAGE
    assert [passes(InvalidRequestLog.MESSAGE) for _ in range(5)] == [None] * 5
    assert passes("Exception in ASGI application") == "Exception in ASGI application"  # others pass
    now[0] = 59.9
    assert passes(InvalidRequestLog.MESSAGE) is None
    now[0] = 60.0
    assert (
        passes(InvalidRequestLog.MESSAGE)
        == f"{InvalidRequestLog.MESSAGE} (6 more held back since the last of these lines)"
    )
    now[0] = 200.0
    assert passes(InvalidRequestLog.MESSAGE) == InvalidRequestLog.MESSAGE


def test_a_head_that_does_not_arrive_in_time_is_answered_408_and_closed(port: int) -> None:
    with _cuts(head_timeout=1), _connect(port) as s:
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
    with _cuts(idle=1), _connect(port) as s:
        t0 = time.monotonic()
        assert _read_all(s) == b""
        assert TIMEOUT_S - 0.1 <= time.monotonic() - t0 < TIMEOUT_S + 2.0


def test_kept_alive_connections_long_streams_and_pipelined_requests_are_served(port: int) -> None:
    with _cuts(), _connect(port) as s:
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


def test_the_body_writer_writes_chunks_of_its_own_started_response(port: int) -> None:
    _wrote.clear()
    with _cuts(), _connect(port) as s:
        s.sendall(_get("/write") + _get("/write"))  # pipelined: each writer writes its own
        for _ in range(2):
            answer = _response(s)
            assert answer.startswith(b"HTTP/1.1 200 ")
            # An empty piece is no chunk (it would end the response); the response ends as sent.
            assert answer.endswith(b"\r\n\r\n1\r\na\r\n2\r\nbc\r\n2\r\n" + _END)
    assert _wrote == ["None"] * 6  # the writes returned nothing to wait for; the early one raised


def test_a_body_that_trickles_is_answered_408_and_closed(port: int) -> None:
    with _cuts(body_timeout=1), _connect(port) as s:
        s.sendall(_post_head("/", 1000))
        t0 = time.monotonic()
        _trickle(s, 1000, 1, 0.1)  # 10 bytes a second: the deadline, 0.6 s + 0.01 s a byte, passes at ~0.67 s
        reply = _read_all(s)
        took = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408 ") and b"connection: close" in reply.lower(), reply
    assert BODY_TIMEOUT_S - 0.1 <= took < BODY_TIMEOUT_S + 2.0


def test_a_steady_upload_longer_than_the_deadline_is_served(port: int) -> None:
    with _cuts(), _connect(port) as s:
        s.sendall(_post_head("/", 300))
        t0 = time.monotonic()
        _trickle(s, 300, 30, 0.1)  # 300 bytes a second, 3 x the rate: its deadline keeps ahead
        assert time.monotonic() - t0 > BODY_TIMEOUT_S
        reply = _response(s)
    assert reply.startswith(b"HTTP/1.1 200 ") and b"300 " in reply, reply


def test_time_the_server_is_not_reading_does_not_count() -> None:
    # Waiting to send 100 Continue until the application asks for the body (uvicorn), and
    # pausing reading past 64 KiB unread: neither is the client's delay.
    with _serve(RequestBounds(MAX_HEAD, TIMEOUT_S, BODY_TIMEOUT_S, 1 << 30, SEND_TIMEOUT_S)) as port, _cuts():
        with _connect(port) as s:
            s.sendall(_post_head("/late", 5, b"Expect: 100-continue\r\n"))
            assert s.recv(65536).startswith(b"HTTP/1.1 100 ")  # after LATE_S
            s.sendall(b"hello")
            assert _response(s).startswith(b"HTTP/1.1 200 ")
        with _connect(port) as s:
            size = 4 << 20  # past what the kernel's buffers and uvicorn's 64 KiB take unread
            s.sendall(_post_head("/late", size))
            sender = threading.Thread(target=s.sendall, args=(b"b" * size,), daemon=True)
            sender.start()
            reply = _response(s)
            sender.join(5)
        assert reply.startswith(b"HTTP/1.1 200 ") and f"{size} ".encode() in reply, reply


def test_a_client_that_stops_reading_is_cut_and_one_that_reads_slowly_is_not(port: int) -> None:
    with _cuts(send_timeout=1), _connect(port) as s:
        s.sendall(_get("/big?64"))  # 64 MiB: far past what the kernel's buffers take unread
        t0 = time.monotonic()
        while "64" not in _sent and time.monotonic() - t0 < SEND_TIMEOUT_S + 3.0:
            time.sleep(0.05)
        # The application's sends returned (the client went away, for it) without a byte read.
        assert "64" in _sent and SEND_TIMEOUT_S - 0.1 <= _sent["64"] - t0 < SEND_TIMEOUT_S + 3.0
        got = b""
        with contextlib.suppress(ConnectionResetError):  # aborted: what the kernel held, then the end
            while chunk := s.recv(MIB):
                got += chunk
        assert got.count(b"y") < 64 * MIB and not got.endswith(_END)
    with _cuts(), _connect(port) as s:
        s.sendall(_get("/big?8"))
        got, t0 = b"", time.monotonic()
        while not got.endswith(_END):
            got += s.recv(256 * 1024)
            time.sleep(0.02)  # ~12 MiB/s: 8 MiB take longer than the deadline, never paused as long
        assert time.monotonic() - t0 > SEND_TIMEOUT_S
        assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"y" * 1024) == 8 * 1024


def test_the_gateway_serves_with_the_fleet_files_bounds(tmp_path: Path) -> None:
    fleet = fleet_dict(["http://127.0.0.1:9"])
    fleet["gateway"].update(
        max_head_bytes=2048,
        head_timeout_s=1.0,
        body_timeout_s=1.0,
        body_min_bytes_per_s=100,
        send_timeout_s=5.0,
    )
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
        with _connect(gw_port) as s:
            s.sendall(_post_head("/v1/chat/completions", 1000, b"Content-Type: application/json\r\n"))
            t0 = time.monotonic()
            _trickle(s, 1000, 1, 0.1)
            assert _read_all(s).startswith(b"HTTP/1.1 408 ")
            assert 0.9 <= time.monotonic() - t0 < 4.0
        for _ in range(5):
            with _connect(gw_port) as s:
                s.sendall(b"\x16\x03\x01 not http\r\n\r\n")
                assert _read_all(s).startswith(b"HTTP/1.1 400 ")
        gw = Gateway(proc, f"http://127.0.0.1:{gw_port}")
        cuts = {labels["reason"]: v for labels, v in gw.samples("tidal_gateway_connections_cut_total")}
        assert cuts == {
            "head_too_large": 1,
            "head_timeout": 1,
            "idle": 0,
            "body_timeout": 1,
            "send_timeout": 0,
            "bad_request": 5,
        }
    finally:
        proc.stop()
    # uvicorn's warning for the 431's head and the five: the first only, within the minute
    warned = (tmp_path / "gateway.log").read_text().count("Invalid HTTP request received.")
    assert warned == 1


def test_the_gateway_cuts_a_stream_nobody_reads_and_frees_its_replica(tmp_path: Path) -> None:
    """Through ``tidal gateway`` to a simulated replica: a client that stops reading a long
    stream is cut once the gateway's writes have waited ``send_timeout_s``, and the request is
    aborted upstream -- the gateway's in-flight count and the replica's running requests both
    drop -- while the stream would have run for several seconds more."""
    sim = sim_process("fast-test", args=["--served-model-name", "m"], log_path=tmp_path / "sim.log")
    fleet = {
        "models": [{"name": "m"}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "replicas": [{"name": "r0", "url": sim.url}],
            }
        },
        "features": {"default": {"context_cap": 32000}},
        "gateway": {"send_timeout_s": 1.0},
    }
    # 8 choices of 8,000 tokens at ~1 ms a step: ~3 MB (what the kernel's buffers take unread)
    # arrive in about two seconds, and the whole answer would take ten or more.
    body = json.dumps(
        {
            "model": "m",
            "stream": True,
            "n": 8,
            "max_tokens": 8000,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + DEV_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )

    def running() -> tuple[float, float]:
        engine = parse_samples(
            httpx.get(sim.url + "/metrics", timeout=10).text, {"vllm:num_requests_running"}
        )
        return gw.metric("tidal_gateway_replica_inflight"), sum(s.value for s in engine)

    with running_process(sim), run_gateway(tmp_path, fleet) as gw:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no autotuning: little is taken
            s.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
            s.sendall(head + body)
            assert s.recv(15).startswith(b"HTTP/1.1 200 ")
            t0 = time.monotonic()
            seen = [running()]
            while seen[-1] != (0.0, 0.0) and time.monotonic() - t0 < 8.0:
                time.sleep(0.2)
                seen.append(running())
            cut_after = time.monotonic() - t0
            assert seen[0][0] == 1.0 and seen[0][1] >= 1.0, seen  # streaming, unread
            assert seen[-1] == (0.0, 0.0), seen  # cut and aborted upstream, long before its end
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(MIB):
                    got += chunk
        assert b"data: [DONE]" not in got and got.count(b"data: {") < 8 * 8000
        assert cut_after >= 1.0  # not before the send deadline
        assert gw.metric("tidal_gateway_connections_cut_total", reason="send_timeout") == 1
