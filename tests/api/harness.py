"""Gateways as real processes on real sockets, and an authenticating provider in front of a replica.

Example::

    with run_gateway(tmp_path, fleet_dict(replicas)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY)
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import uvicorn
import yaml
from aiohttp import web
from starlette.types import ASGIApp

from tidal.api.protocol import RequestBounds, bounded_protocol
from tidal.fleet import hash_api_key
from tidal.replicas.launcher import ReplicaProcess, free_port
from tidal.replicas.wire.prom import parse_samples
from tidal.router.ring import HashRing, stable_hash

__all__ = [
    "ThreadedServer",
    "ACME_KEY",
    "ADMIN_KEY",
    "DEV_KEY",
    "AuthProxy",
    "Gateway",
    "fleet_dict",
    "play_until",
    "run_gateway",
    "serve_asgi",
    "session_for",
]

DEV_KEY = "dev-key-for-tests-0123456789"
ADMIN_KEY = "admin-key-for-tests-0123456789"
ACME_KEY = "acme-key-for-tests-0123456789"


def with_embedding_pool(fleet: dict[str, Any], urls: list[str], model: str = "tiny-embed") -> dict[str, Any]:
    """``fleet`` plus an embedding model served by a pool of its own on ``urls`` (embedding
    requests for a generative model are refused by the gateway)."""
    fleet["models"].append({"name": model, "embedding": True})
    fleet["pools"]["embed"] = {
        "kind": "interactive",
        "model": model,
        "replicas": [{"name": f"embed-{i}", "url": u} for i, u in enumerate(urls)],
    }
    return fleet


def fleet_dict(
    replica_urls: list[str],
    *,
    adapters: dict[str, str] | None = None,
    cap: int = 64,
    min_cap: int = 1,
    max_queue: int = 256,
    wait_budget_s: float = 2.0,
    tpot_slo_s: float = 0.05,
    external: str | None = None,
    max_loras: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """A fleet of tiny-model replicas: features chat (acme's), default, regulated and pinned."""
    data: dict[str, Any] = {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "adapters": [{"name": n, "path": p, "base_model": "tiny"} for n, p in (adapters or {}).items()],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "tiny",
                "max_inflight_per_replica": cap,
                "min_inflight_per_replica": min(min_cap, cap),
                "replicas": [
                    {"name": f"replica-{i}", "url": u, "max_loras": max_loras}
                    for i, u in enumerate(replica_urls)
                ],
            }
        },
        "classes": {
            "interactive": {"priority": 0, "wait_budget_s": wait_budget_s, "tpot_slo_s": tpot_slo_s},
            "batch": {"priority": 100, "wait_budget_s": 3600, "tpot_slo_s": 1.0, "ttft_slo_s": 3600},
        },
        "features": {
            "default": {"class": "interactive", "context_cap": 3000},
            "chat": {"class": "interactive", "context_cap": 2048},
            "claims": {"class": "interactive", "context_cap": 3000, "regulated": True},
        },
        "tenants": [{"name": "acme", "key_hashes": [hash_api_key(ACME_KEY)], "features": ["chat"]}],
        "gateway": {"max_queue": max_queue, "scrape_interval_s": 0.5},
    }
    if external is not None:
        data["external_provider"] = {"url": external, "api_key_env": "TIDAL_TEST_PROVIDER_KEY"}
        data["features"]["hard"] = {"class": "interactive", "context_cap": 3000, "pin_external": True}
    data.update(extra)
    return data


T = TypeVar("T")


def play_until(scene: Callable[[], T], conclusive: Callable[[T], bool], times: int = 3) -> list[T]:
    """Play a scene that races a real stream until one play is ``conclusive``, at most ``times``;
    every play's outcome, the last one last.

    A process of this small shared machine is now and then not scheduled for seconds, long
    enough for a stream of a few seconds to end before the test's action reaches the gateway. A
    scene whose action never works is inconclusive every time, so the caller's assertion on the
    last play still fails.
    """
    plays = [scene()]
    while len(plays) < times and not conclusive(plays[-1]):
        plays.append(scene())
    return plays


def session_for(target: str, names: list[str]) -> str:
    """A session id (``X-Session-Id``) whose home on the gateway's session ring is ``target``."""
    ring = HashRing(names)
    for i in range(10_000):
        sid = f"session-{i}"
        if next(ring.walk(stable_hash(sid.encode()))) == target:
            return sid
    raise AssertionError("no session maps to the target")


@dataclass
class Gateway:
    proc: ReplicaProcess
    url: str

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(
            method, self.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
        )

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a gateway metric's samples matching ``labels``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(
            s.value
            for s in parse_samples(text)
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def sse(
        self, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60
    ) -> AbstractContextManager[httpx.Response]:
        """A raw streaming chat request (no SDK in between), with the developer key."""
        return httpx.stream(
            "POST",
            self.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {DEV_KEY}", **(headers or {})},
            timeout=timeout,
        )

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return [(s.labels, s.value) for s in parse_samples(text) if s.name == name]

    def rss_bytes(self) -> int:
        assert self.proc.pid is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def running(proc: ReplicaProcess, timeout: float = 60) -> Iterator[ReplicaProcess]:
    """``proc`` started and ready (``GET`` of its health path answers 200); stopped on exit."""
    proc.start()
    try:
        proc.wait_ready(timeout)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def run_gateway(
    tmp_path: Path, fleet: dict[str, Any], env: dict[str, str] | None = None, log_level: str = "INFO"
) -> Iterator[Gateway]:
    """``tidal gateway`` as a subprocess on a free port; stopped on exit."""
    path = tmp_path / f"fleet-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(fleet))
    port = free_port()
    proc = ReplicaProcess(
        "gateway",
        [
            sys.executable,
            "-m",
            "tidal",
            "--log-level",
            log_level,
            "gateway",
            "--config",
            str(path),
            "--port",
            str(port),
        ],
        port=port,
        env={"TIDAL_ADMIN_KEY": ADMIN_KEY, "TIDAL_DEV_API_KEY": DEV_KEY, **(env or {})},
        log_path=tmp_path / f"gateway-{port}.log",
        health_path="/healthz",
    )
    with running(proc):
        yield Gateway(proc, proc.url)


class ThreadedServer:
    """An aiohttp application served on ``127.0.0.1:port`` from a thread of its own (a fake
    provider or replica beside the real processes); stop it by leaving the ``with``."""

    def __init__(self, app: web.Application, port: int) -> None:
        self.app, self.port = app, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ThreadedServer:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            runner = web.AppRunner(self.app)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"the threaded server on port {self.port} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


@contextlib.contextmanager
def serve_asgi(app: ASGIApp, bounds: RequestBounds, *, lifespan: str = "off") -> Iterator[int]:
    """``app`` served by uvicorn with the gateway's server protocol, from a thread of this process
    (so a test can look inside it); yields the port."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="asyncio",
        http=bounded_protocol(bounds),
        log_level="warning",
        lifespan=lifespan,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class AuthProxy:
    """An OpenAI-compatible "external provider": checks its own API key, forwards to a replica."""

    upstream: str
    key: str
    port: int = field(default_factory=free_port)
    requests: int = 0
    refused: int = 0
    _server: ThreadedServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            self.refused += 1
            return web.json_response(
                {"error": {"message": "bad key", "type": "auth", "code": None}}, status=401
            )
        self.requests += 1
        body = await request.read()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                self.upstream + request.path, data=body, headers={"Content-Type": "application/json"}
            ) as up,
        ):
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    def __enter__(self) -> AuthProxy:
        app = web.Application()
        app.router.add_post("/v1/{tail:.*}", self._handle)
        self._server = ThreadedServer(app, self.port).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc)
