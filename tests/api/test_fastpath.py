"""The inference routes' raw ASGI path answers exactly as the FastAPI routes would.

Every request is sent twice, to the gateway application (which serves the inference routes
ahead of FastAPI) and to its ``full_stack`` alone (the documented FastAPI routes), and the
answers must be identical; well-formed requests must not reach FastAPI at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Receive, Scope, Send

from tests.api.harness import fleet_dict, with_embedding_pool
from tidal.api.app import GatewayApp, create_app
from tidal.api.auth import KeyStore, Principal
from tidal.fleet import FleetConfig
from tidal.settings import Settings

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
LIMIT = 64 * 1024


def _app() -> GatewayApp:
    keys = KeyStore()
    keys.add_key("dev-key", Principal("dev", frozenset({"*"})))
    keys.add_key("acme-key", Principal("acme", frozenset({"chat"})))
    fleet = FleetConfig.model_validate(
        with_embedding_pool(
            fleet_dict(["http://127.0.0.1:9"], gateway={"max_queue": 16, "max_body_bytes": LIMIT}),
            ["http://127.0.0.1:9"],
        )
    )
    app = create_app(fleet, Settings(_env_file=None), keys=keys)
    assert isinstance(app, GatewayApp)
    return app


class _FullStack:
    """The same application with the raw path bypassed: what FastAPI alone answers."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.app.full_stack(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class _Spy:
    """Counts the requests an endpoint hands to FastAPI."""

    def __init__(self, app: GatewayApp) -> None:
        self.calls = 0
        endpoints = app.endpoints()
        self.inner = next(iter(endpoints.values())).fallback
        for endpoint in endpoints.values():
            endpoint.fallback = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await self.inner(scope, receive, send)


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient, _Spy]]:
    app = _app()
    spy = _Spy(app)
    yield TestClient(app), TestClient(_FullStack(app)), spy


def _headers(
    key: str | None = "dev-key", ctype: str | None = "application/json", **extra: str
) -> dict[str, str]:
    h = dict(extra)
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    if ctype is not None:
        h["Content-Type"] = ctype
    return h


def _body(payload: bytes | dict[str, Any]) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


CASES: list[tuple[str, str, bytes | dict[str, Any], dict[str, str]]] = [
    ("malformed JSON", CHAT, b'{"model": "tiny", "messages": [', _headers()),
    ("malformed JSON, no key", CHAT, b'{"model": "tiny"', _headers(key=None)),
    ("wrong type", CHAT, {"model": "tiny", "messages": "hello"}, _headers()),
    ("missing field", CHAT, {"model": "tiny"}, _headers()),
    ("bad role", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, _headers()),
    ("refused field", CHAT, {"model": "tiny", "messages": MSG, "logits_processors": ["x"]}, _headers()),
    (
        "remote media",
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": [{"image_url": {"url": "http://x/"}}]}]},
        _headers(),
    ),
    ("no key", CHAT, {"model": "tiny", "messages": MSG}, _headers(key=None)),
    ("wrong key", CHAT, {"model": "tiny", "messages": MSG}, _headers(key="nope")),
    (
        "basic auth",
        CHAT,
        {"model": "tiny", "messages": MSG},
        {**_headers(key=None), "Authorization": "Basic x"},
    ),
    ("bad key and bad body", CHAT, {"model": "tiny"}, _headers(key="nope")),
    ("text content type", CHAT, {"model": "tiny", "messages": MSG}, _headers(ctype="text/plain")),
    ("no content type", CHAT, {"model": "tiny", "messages": MSG}, _headers(ctype=None)),
    ("json-like type", CHAT, {"model": "tiny", "messages": MSG}, _headers(ctype="application/jsonx")),
    ("empty body", CHAT, b"", _headers()),
    ("json array", CHAT, b"[1, 2]", _headers()),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, _headers()),
    (
        "over the context cap",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": 5000},
        _headers("acme-key"),
    ),
    (
        "feature not allowed",
        CHAT,
        {"model": "tiny", "messages": MSG},
        _headers("acme-key", **{"X-Tidal-Feature": "claims"}),
    ),
    ("unknown feature", CHAT, {"model": "tiny", "messages": MSG}, _headers(**{"x-tidal-feature": "nope"})),
    ("completions: bad prompt", "/v1/completions", {"model": "tiny", "prompt": []}, _headers()),
    ("completions: no key", "/v1/completions", {"model": "tiny", "prompt": "x"}, _headers(key=None)),
    (
        "embeddings: bad format",
        "/v1/embeddings",
        {"model": "tiny", "input": "x", "encoding_format": "y"},
        _headers(),
    ),
    ("over the body limit", CHAT, b"{" + b" " * LIMIT + b"}", _headers()),
]


@pytest.mark.parametrize(("case", "path", "payload", "headers"), CASES, ids=[c[0] for c in CASES])
def test_refusals_match_the_fastapi_routes(
    clients: tuple[TestClient, TestClient, _Spy],
    case: str,
    path: str,
    payload: bytes | dict[str, Any],
    headers: dict[str, str],
) -> None:
    fast, full, _ = clients
    a = fast.post(path, content=_body(payload), headers=headers)
    b = full.post(path, content=_body(payload), headers=headers)
    assert 400 <= a.status_code < 500, a.text
    assert (a.status_code, a.json()) == (b.status_code, b.json())
    assert set(a.json()["error"]) == {"message", "type", "param", "code"}


def test_a_body_over_the_limit_without_length_is_refused_as_it_arrives(
    clients: tuple[TestClient, TestClient, _Spy],
) -> None:
    fast, full, _ = clients

    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b" " * (LIMIT // 2)

    a = fast.post(CHAT, content=chunks(), headers=_headers())
    b = full.post(CHAT, content=chunks(), headers=_headers())
    assert a.status_code == b.status_code == 413
    assert a.json() == b.json() and a.json()["error"]["code"] == "request_too_large"


def test_well_formed_requests_do_not_reach_fastapi(clients: tuple[TestClient, TestClient, _Spy]) -> None:
    fast, full, spy = clients
    before = spy.calls
    for path, payload in (
        (CHAT, {"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 4}),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}),
        ("/v1/embeddings", {"model": "tiny-embed", "input": "x"}),
    ):
        # The app was not started, so no replica has a client: the proxy answers 503 no_replica.
        a = fast.post(path, content=_body(payload), headers=_headers(ctype="application/json; charset=utf-8"))
        b = full.post(path, content=_body(payload), headers=_headers())
        assert a.status_code == b.status_code == 503, a.text
        assert a.json() == b.json() and a.json()["error"]["code"] == "no_replica"
        assert a.headers["retry-after"] == "1"
    assert spy.calls == before
    # Other methods and paths go through FastAPI as before.
    assert fast.get(CHAT, headers=_headers()).status_code == 405
    assert fast.get("/healthz").json() == {"status": "ok"}
    assert spy.calls == before


def test_gateway_histograms_expose_cumulative_buckets(clients: tuple[TestClient, TestClient, _Spy]) -> None:
    fast, _, _ = clients
    fast.post(CHAT, content=_body({"model": "tiny", "messages": MSG}), headers=_headers())
    families = {f.name: f for f in text_string_to_metric_families(fast.get("/metrics").text)}
    plugin = families["tidal_router_plugin_duration_seconds"]
    assert plugin.type == "histogram"
    by_series: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    counts: dict[tuple[str, ...], float] = {}
    for s in plugin.samples:
        key = (s.labels["extension"], s.labels["type"], s.labels["name"])
        if s.name.endswith("_bucket"):
            by_series.setdefault(key, []).append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_count"):
            counts[key] = s.value
    assert ("filter", "healthy-filter", "healthy-filter") in by_series
    for series, buckets in by_series.items():
        values = [v for _, v in sorted(buckets)]
        assert values == sorted(values) and values[-1] == counts[series] >= 1
        assert sorted(buckets)[-1][0] == float("inf")
