"""``tidal gateway`` with the ``openai`` SDK in front of a replica that speaks legal but unusual
HTTP: SSE framed with CRLF (sse-starlette's default), an interim ``103 Early Hints`` before every
answer (what a CDN in front of a provider sends), a stray response written after each answer on
the same connection (glued to its end, or later while the connection is idle), and two
data-parallel engines on ``/metrics``.

(A response that arrives on a connection after the next request went out on it cannot be told
from that request's answer in HTTP/1.1, by any client: the stray answers here arrive before.)

The replica is a raw socket server (in a thread of the test) so that it writes exactly these
bytes; each answer repeats its request's marker, so an answer that reached another request shows.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from tests.api.harness import (
    ADMIN_KEY,
    DEV_KEY,
    Gateway,
    fleet_dict,
    run_gateway,
    serve_asgi,
    with_embedding_pool,
)
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.api.protocol import RequestBounds
from tidal.fleet import FleetConfig
from tidal.settings import Settings

TOKEN_GAP_S = 0.25
_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.6
"""


class QuirkyReplica:
    """An OpenAI-compatible replica whose HTTP is legal but unusual (see the module docstring)."""

    def __init__(self) -> None:
        self.port = 0
        self.requests = 0
        self._broken: set[str] = set()  # markers whose first stream was cut (``break_once``)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> QuirkyReplica:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                body = await reader.readexactly(int(m.group(1))) if m else b""
                method, path = head.split(b" ", 2)[:2]
                await self._answer(method, path.decode(), body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _plain(
        writer: asyncio.StreamWriter, status: str, body: bytes, ctype: bytes = b"application/json"
    ) -> None:
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode()
            + b"Content-Type: "
            + ctype
            + b"\r\n\r\n"
            + body
        )

    async def _answer(self, method: bytes, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == "/metrics":
            self._plain(writer, "200 OK", _METRICS.encode(), b"text/plain; version=0.0.4")
            return
        if path in ("/health", "/v1/models") or method != b"POST":
            models = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]}
            self._plain(writer, "200 OK", json.dumps(models).encode() if path == "/v1/models" else b"")
            return
        if path == "/v1/embeddings":  # a legal 203 (say, from a transforming proxy): passed on
            vector = {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}
            answer = {"object": "list", "model": "tiny", "data": [vector], "usage": _usage(0)}
            self._plain(writer, "203 Non-Authoritative Information", json.dumps(answer).encode())
            return
        self.requests += 1
        request = json.loads(body)
        marker = request["messages"][-1]["content"]
        words = marker.split()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
        await writer.drain()
        if not request.get("stream"):  # what the gateway no longer asks for chat
            tail = _plain("200 OK", json.dumps(_completion(marker)).encode())
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            events = [_chunk({"role": "assistant", "content": ""})]
            events += [_chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
            events += [_chunk({}, "stop"), {"id": "chatcmpl-q", "choices": [], "usage": _usage(len(words))}]
            for i, event in enumerate(events):
                data = b"data: " + json.dumps(event).encode() + b"\r\n\r\n"
                if i == 0:
                    data = b": framed with CRLF\r\n" + data
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                if request.get("break_once") and i == 2 and marker not in self._broken:
                    self._broken.add(marker)  # the engine dies part-way through this answer
                    writer.transport.abort()
                    return
                if request.get("slow") and 1 <= i <= len(words):
                    await asyncio.sleep(TOKEN_GAP_S)
            done = b"data: [DONE]\r\n\r\n"
            tail = f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n"
        # A stray answer on the same connection after the real one: glued to its end, or, for the
        # requests that ask, while the connection is idle. It must never become an answer.
        stray = _plain("200 OK", json.dumps(_completion("STRAY " + marker)).encode())
        if request.get("stray_later"):
            writer.write(tail)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(stray)
        else:
            writer.write(tail + stray)


def _plain(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nContent-Type: ".encode()
    return head + ctype + b"\r\n\r\n" + body


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-q",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-q",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": _usage(len(text.split())),
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, QuirkyReplica]]:
    with QuirkyReplica() as replica:
        fleet = with_embedding_pool(fleet_dict([replica.url]), [replica.url])
        with run_gateway(tmp_path_factory.mktemp("gw-wire"), fleet) as gw:
            yield gw, replica


def test_tokens_stream_as_they_are_produced_over_crlf_framing(gateway: tuple[Gateway, QuirkyReplica]) -> None:
    gw, _ = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
    started = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "one two three four five six"}],
        stream=True,
        extra_body={"slow": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append((time.monotonic() - started, chunk.choices[0].delta.content))
    assert "".join(t for _, t in arrivals) == "one two three four five six"
    first, last = arrivals[0][0], arrivals[-1][0]
    # Six tokens 250 ms apart: streamed, the first arrives >= 1.25 s before the last; buffered,
    # all arrive together.
    assert last - first > 0.8, arrivals


def test_every_answer_reaches_its_own_request_under_64_concurrent_requests(
    gateway: tuple[Gateway, QuirkyReplica],
) -> None:
    gw, replica = gateway
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0, timeout=60)

    async def ask(i: int, stream: bool) -> str:
        marker = f"request {i} says {i * 7919 % 1000}"
        messages: Any = [{"role": "user", "content": marker}]
        if stream:
            out = []
            async for chunk in await client.chat.completions.create(
                model="tiny", messages=messages, stream=True
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    out.append(chunk.choices[0].delta.content)
            answer = "".join(out)
        else:
            reply = await client.chat.completions.create(model="tiny", messages=messages)
            answer = reply.choices[0].message.content or ""
            assert reply.usage is not None and reply.usage.completion_tokens == len(marker.split())
        return f"{i}:{answer}"

    async def rounds() -> list[str]:
        answers = []
        for r in range(3):
            answers += await asyncio.gather(*(ask(i, stream=(i + r) % 2 == 0) for i in range(64)))
        await client.close()
        return answers

    before = replica.requests
    ttfts = gw.metric("tidal_gateway_ttft_seconds_count")
    answers = asyncio.run(rounds())
    expected = [f"{i}:request {i} says {i * 7919 % 1000}" for _ in range(3) for i in range(64)]
    assert answers == expected
    assert replica.requests - before == 3 * 64  # no request was sent twice
    # Streaming or not, every request's time to first token was measured.
    assert gw.metric("tidal_gateway_ttft_seconds_count") - ttfts == 3 * 64


def test_kv_usage_of_data_parallel_engines_stays_within_0_and_1(
    gateway: tuple[Gateway, QuirkyReplica],
) -> None:
    gw, _ = gateway
    deadline = time.monotonic() + 10
    snapshot = None
    while time.monotonic() < deadline:
        listing = httpx.get(gw.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        snapshot = listing.json()["data"][0]["snapshot"]
        if snapshot is not None:
            break
        time.sleep(0.2)
    assert snapshot is not None
    assert snapshot["kv_cache_usage"] == pytest.approx(0.6)
    assert snapshot["num_running"] == 7 and snapshot["num_waiting"] == 3


def test_a_stray_answer_on_an_idle_connection_never_becomes_one(
    gateway: tuple[Gateway, QuirkyReplica],
) -> None:
    gw, _ = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
    for i in range(6):
        marker = f"idle {i}"
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": marker}], extra_body={"stray_later": True}
        )
        assert reply.choices[0].message.content == marker
        time.sleep(0.2)  # the stray answer lands while the connection is idle


class _Stamp:
    """A user's pure ASGI middleware: stamps each response and counts the body chunks it sees."""

    chunks = 0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-stamp", b"seen")]
            elif message["type"] == "http.response.body" and message.get("body"):
                _Stamp.chunks += 1
            await send(message)

        await self.app(scope, receive, stamped)


def test_middleware_the_gateway_adds_applies_to_streams() -> None:
    with QuirkyReplica() as replica:
        fleet = FleetConfig.model_validate(fleet_dict([replica.url]))
        keys = KeyStore()
        keys.add_key(DEV_KEY, Principal("dev", frozenset({"*"})))
        app = create_app(fleet, Settings(_env_file=None), keys=keys)
        app.add_middleware(_Stamp)
        app.add_middleware(CORSMiddleware, allow_origins=["https://app.example"])
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "a b c d"}],
            "stream": True,
            "slow": True,
        }
        headers = {"Authorization": f"Bearer {DEV_KEY}", "Origin": "https://app.example"}
        with (
            TestClient(app) as client,
            client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            text = "".join(resp.iter_text())
        assert resp.status_code == 200
        assert resp.headers["x-stamp"] == "seen"
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        assert text.count("data: ") >= 6 and "[DONE]" in text
        assert _Stamp.chunks >= 4  # the tokens come 250 ms apart, each through the middleware


def test_a_finished_request_leaves_nothing_to_the_garbage_collector() -> None:
    """A request's scope, server cycle and body writer go as it ends, by reference counting: a
    reference cycle among them (the scope holding the server's ``send`` or body writer, which hold
    the cycle, which holds the scope) left every request to the collector, whose passes over a
    busy gateway's in-flight requests stall its loop. Served in this process, with the
    collector off, so what a cycle keeps stays countable."""
    with QuirkyReplica() as replica:
        fleet = FleetConfig.model_validate(fleet_dict([replica.url]))
        keys = KeyStore()
        keys.add_key(DEV_KEY, Principal("dev", frozenset({"*"})))
        app = create_app(fleet, Settings(_env_file=None), keys=keys)
        with serve_asgi(app, RequestBounds(), lifespan="on") as port, httpx.Client(timeout=30) as client:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}], "stream": True}
            headers = {"Authorization": f"Bearer {DEV_KEY}"}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            client.post(url, json=body, headers=headers).read()  # (the connection, and lazy state)
            gc.collect()
            gc.disable()
            try:
                for _ in range(10):  # on one kept-alive connection
                    with client.stream("POST", url, json=body, headers=headers) as resp:
                        assert resp.status_code == 200
                        assert "[DONE]" in resp.read().decode()
                time.sleep(0.2)  # (the last request's task ends after its last byte)
                # (by type, not isinstance: that reads every object's __class__, which some warn on)
                left = sum(type(o) is RequestResponseCycle for o in gc.get_objects())
            finally:
                gc.enable()
    assert left <= 1, f"{left} server cycles outlived their requests"  # (the connection keeps its last)


def test_the_upstream_status_is_passed_through(gateway: tuple[Gateway, QuirkyReplica]) -> None:
    gw, _ = gateway
    resp = httpx.post(
        gw.url + "/v1/embeddings",
        json={"model": "tiny-embed", "input": "hello"},
        headers={"Authorization": f"Bearer {DEV_KEY}"},
        timeout=30,
    )
    assert resp.status_code == 203
    assert resp.json()["data"][0]["embedding"] == [0.5, 0.25]


def test_a_client_that_leaves_is_not_a_replica_failure(gateway: tuple[Gateway, QuirkyReplica]) -> None:
    gw, _ = gateway
    errors = gw.metric("tidal_gateway_upstream_errors_total")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a b c d e f"}],
        "stream": True,
        "slow": True,
    }
    for _ in range(3):
        with gw.sse(body) as resp:
            for line in resp.iter_lines():
                if '"content"' in line and '"content": ""' not in line:
                    break  # the first token: leave mid-stream
    time.sleep(1.0)
    load = httpx.get(gw.url + "/admin/load", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert gw.metric("tidal_gateway_upstream_errors_total") == errors
    assert load["pools"]["interactive"]["error_rate"] == 0.0
    assert all(g["errors"] == 0 for g in load["groups"].values())


def test_a_stream_that_breaks_part_way_is_retried_only_where_the_client_saw_nothing(
    gateway: tuple[Gateway, QuirkyReplica],
) -> None:
    """Kept last: the broken streams count as the replica's failures."""
    gw, replica = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
    # A non-streaming answer reaches the client only once its stream has ended: one retry, and
    # the client gets the whole answer.
    before, retries = replica.requests, gw.metric("tidal_gateway_retries_total")
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "cut one two three"}],
        extra_body={"break_once": True},
    )
    assert reply.choices[0].message.content == "cut one two three"
    assert replica.requests - before == 2 and gw.metric("tidal_gateway_retries_total") == retries + 1
    # A streaming one already passed tokens on: it ends with a retryable error event, not retried.
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "cut four five six"}],
        "stream": True,
        "break_once": True,
    }
    before = replica.requests
    with gw.sse(body) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "upstream_failed" and error["retryable"] is True
    assert replica.requests - before == 1
