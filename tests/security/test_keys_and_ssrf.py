"""Security review against a real gateway process: no API key in any log line (at DEBUG) nor
sent to a replica, and no request able to make the gateway reach an address it was not
configured with.

One run: ``tidal gateway`` (logging at DEBUG) in front of a simulated replica seen through a
recording pass-through, and a canary listener that counts every connection made to it. Tenants
and an admin send normal requests, wrong keys, and requests that carry the canary's address
everywhere a URL could hide (model names, image parts, headers that proxies trust, batch line
URLs and endpoints, a replica registration by a tenant). Then: the canary saw no connection, the
replica saw no client key, and no log line holds a key.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from tests.api.harness import ACME_KEY, ADMIN_KEY, DEV_KEY, ThreadedServer, fleet_dict, run_gateway
from tidal.replicas.launcher import free_port, sim_process

pytestmark = pytest.mark.slow

WRONG_KEY = "sk-wrong-key-never-issued-0123456789abcd"
KEYS = (ACME_KEY, ADMIN_KEY, DEV_KEY, WRONG_KEY)


@dataclass
class Canary:
    """A TCP listener that only counts the connections made to it."""

    port: int = field(default_factory=free_port)
    connections: int = 0
    _sock: socket.socket | None = None

    def __enter__(self) -> Canary:
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._sock.settimeout(0.2)

        def accept() -> None:
            assert self._sock is not None
            while self._sock.fileno() != -1:
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                self.connections += 1
                conn.close()

        threading.Thread(target=accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Recorder:
    """A pass-through in front of a replica that keeps every request's headers."""

    upstream: str
    port: int = field(default_factory=free_port)
    headers: list[dict[str, str]] = field(default_factory=list)
    _server: ThreadedServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        body = await request.read()
        fwd = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, self.upstream + request.path_qs, data=body, headers=fwd) as up,
        ):
            resp = web.StreamResponse(status=up.status)
            if "Content-Type" in up.headers:
                resp.headers["Content-Type"] = up.headers["Content-Type"]
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    def __enter__(self) -> Recorder:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._server = ThreadedServer(app, self.port).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The whole scenario, once; the tests read what it left."""
    tmp = tmp_path_factory.mktemp("security")
    sim = sim_process("fast-test", args=["--served-model-name", "tiny"], log_path=tmp / "sim.log")
    sim.start()
    try:
        sim.wait_ready(60)
        with Canary() as canary, Recorder(sim.url) as recorder:
            fleet = fleet_dict([recorder.url])
            env = {
                "TIDAL_DATA_DIR": str(tmp / "data"),
                "TIDAL_BROKER_URL": "filesystem://",
                "TIDAL_BROKER_DIR": str(tmp / "data" / "broker"),
            }
            with run_gateway(tmp, fleet, env=env, log_level="DEBUG") as gw:
                statuses = _traffic(gw.url, canary.url)
                log_path = gw.proc.log_path
            assert log_path is not None
            yield {
                "statuses": statuses,
                "canary": canary.connections,
                "replica_headers": list(recorder.headers),
                "logs": {
                    "gateway": Path(log_path).read_text(errors="replace"),
                    "sim": (tmp / "sim.log").read_text(),
                },
            }
    finally:
        sim.stop()


def _traffic(gw: str, canary: str) -> dict[str, int]:
    """Every request of the scenario; returns the status each one got, by name."""
    out: dict[str, int] = {}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def h(key: str | None, **extra: str) -> dict[str, str]:
        return {**({"Authorization": f"Bearer {key}"} if key else {}), **extra}

    with httpx.Client(base_url=gw, timeout=30) as c:
        out["chat"] = c.post("/v1/chat/completions", json=chat, headers=h(DEV_KEY)).status_code
        with c.stream(
            "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=h(ACME_KEY)
        ) as r:
            r.read()
            out["chat stream"] = r.status_code
        out["models"] = c.get("/v1/models", headers=h(ACME_KEY)).status_code
        out["wrong key"] = c.post("/v1/chat/completions", json=chat, headers=h(WRONG_KEY)).status_code
        out["wrong key as api-key"] = c.post(
            "/v1/chat/completions", json=chat, headers={"api-key": WRONG_KEY, "x-api-key": WRONG_KEY}
        ).status_code
        out["admin load"] = c.get("/admin/load", headers=h(ADMIN_KEY)).status_code
        out["admin with tenant key"] = c.get("/admin/load", headers=h(ACME_KEY)).status_code

        # The canary's address wherever a URL could hide.
        host = canary.removeprefix("http://")
        out["model is a URL"] = c.post(
            "/v1/chat/completions", json={**chat, "model": canary + "/v1"}, headers=h(DEV_KEY)
        ).status_code
        out["model path is a URL"] = c.get(f"/v1/models/{canary}/v1", headers=h(DEV_KEY)).status_code
        image = {"type": "image_url", "image_url": {"url": canary + "/cat.png"}}
        out["image part"] = c.post(
            "/v1/chat/completions",
            json={
                **chat,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}],
            },
            headers=h(DEV_KEY),
        ).status_code
        out["proxy headers"] = c.post(
            "/v1/chat/completions",
            json=chat,
            headers=h(
                DEV_KEY,
                **{
                    "X-Forwarded-Host": host,
                    "X-Forwarded-For": "127.0.0.1",
                    "Forwarded": f"host={host};proto=http",
                    "X-Original-URL": canary + "/v1/chat/completions",
                    "X-Rewrite-URL": canary + "/v1/chat/completions",
                },
            ),
        ).status_code
        out["host header"] = c.post(
            "/v1/chat/completions", json=chat, headers=h(DEV_KEY, Host=host)
        ).status_code
        line = {"custom_id": "a", "method": "POST", "url": canary + "/v1/chat/completions", "body": chat}
        f = c.post(
            "/v1/files",
            files={"file": ("in.jsonl", (json.dumps(line) + "\n").encode())},
            data={"purpose": "batch"},
            headers=h(DEV_KEY),
        )
        out["upload"] = f.status_code
        fid = f.json().get("id", "file-x")
        created = c.post(
            "/v1/batches",
            json={"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            headers=h(DEV_KEY),
        )
        out["batch line URL"] = created.status_code
        # The lines are checked as the batch is ingested: it fails, naming the line's url.
        deadline = time.monotonic() + 30
        batch = created.json()
        while batch.get("status") not in ("failed", "completed", "cancelled", "expired"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = c.get(f"/v1/batches/{batch['id']}", headers=h(DEV_KEY)).json()
        errors = (batch.get("errors") or {}).get("data") or []
        out["batch line URL refused"] = int(
            batch["status"] == "failed" and any(e.get("param") == "url" for e in errors)
        )
        out["batch endpoint URL"] = c.post(
            "/v1/batches",
            json={
                "input_file_id": fid,
                "endpoint": canary + "/v1/chat/completions",
                "completion_window": "24h",
            },
            headers=h(DEV_KEY),
        ).status_code
        out["tenant registers a replica"] = c.post(
            "/admin/replicas",
            json={"name": "evil", "url": canary, "pool": "interactive"},
            headers=h(ACME_KEY),
        ).status_code
        out["tenant points a replica"] = c.patch(
            "/admin/replicas/replica-0", json={"url": canary}, headers=h(ACME_KEY)
        ).status_code
    return out


def test_no_request_reaches_an_address_the_gateway_was_not_configured_with(run: dict[str, Any]) -> None:
    s = run["statuses"]
    assert s["chat"] == s["chat stream"] == s["models"] == s["admin load"] == 200, s
    assert s["proxy headers"] == s["host header"] == 200, s  # served, by the configured replica
    assert s["image part"] in (200, 400), s  # the replica's answer (this one serves text only)
    assert s["model is a URL"] == s["model path is a URL"] == 404, s
    assert s["wrong key"] == s["wrong key as api-key"] == 401, s
    assert (
        s["admin with tenant key"] == s["tenant registers a replica"] == s["tenant points a replica"] == 403
    ), s
    assert s["batch endpoint URL"] == 400, s
    # A line addressed to another host fails its batch at ingestion, never sent anywhere.
    assert s["upload"] == s["batch line URL"] == 200 and s["batch line URL refused"] == 1, s
    assert run["canary"] == 0, f"the gateway connected to the canary {run['canary']} time(s)"


def test_no_key_reaches_a_log_line_or_a_replica(run: dict[str, Any]) -> None:
    lines = [(name, line) for name, text in run["logs"].items() for line in text.splitlines()]
    assert any("gateway on http" in line for _, line in lines)  # the logs of this run were read
    for key in KEYS:
        leaks = [f"{name}: {line}" for name, line in lines if key in line or key[:16] in line]
        assert not leaks, "\n".join(leaks[:5])
    assert run["replica_headers"], "the replica saw no request"
    for headers in run["replica_headers"]:
        for key in KEYS:
            assert not any(key in v for v in headers.values()), headers
