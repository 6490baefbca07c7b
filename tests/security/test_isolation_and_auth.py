"""Security review, tested in-process: every admin route refuses tenant keys, a tenant reaches
none of another tenant's resources (and cannot tell them from ids that do not exist), and keys
are held only as hashes.

The routes are enumerated from the app itself, so a route added later without the admin
dependency fails here rather than being forgotten in a list.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.fleet import hash_api_key, parse_fleet
from tidal.settings import Settings

KEY_A = "sk-tenant-a-0123456789abcdef0123456789"
KEY_B = "sk-tenant-b-0123456789abcdef0123456789"
KEY_ADMIN = "sk-admin-0123456789abcdef0123456789ab"
DATASET = b'{"prompt": "2+2?", "reference": "4"}\n'
BATCH_LINE = json.dumps(
    {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    }
).encode()


@pytest.fixture
def tc(tmp_path: Path) -> Iterator[TestClient]:
    fleet = parse_fleet(
        {
            "models": [{"name": "tiny", "max_model_len": 4096}],
            "adapters": [{"name": "a-only", "path": "/x", "base_model": "tiny", "tenants": ["tenant-a"]}],
            "pools": {
                "interactive": {
                    "kind": "interactive",
                    "model": "tiny",
                    "replicas": [{"name": "r", "url": "http://127.0.0.1:9", "max_loras": 2}],
                },
            },
            "tenants": [
                {"name": "tenant-a", "key_hashes": [hash_api_key(KEY_A)], "features": ["*"]},
                {"name": "tenant-b", "key_hashes": [hash_api_key(KEY_B)], "features": ["*"]},
            ],
        }
    )
    settings = Settings(_env_file=None, data_dir=tmp_path, broker_url="memory://")
    keys = KeyStore()
    keys.add_key(KEY_A, Principal("tenant-a", frozenset({"*"})))
    keys.add_key(KEY_B, Principal("tenant-b", frozenset({"*"})))
    keys.add_key(KEY_ADMIN, Principal("ops", frozenset({"*"}), admin=True))
    with TestClient(create_app(fleet, settings, keys=keys)) as client:
        yield client


def _h(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _openai_error(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


def _admin_routes(tc: TestClient) -> list[tuple[str, str]]:
    app: Any = tc.app
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path.startswith("/admin"):
            for method in sorted(route.methods - {"HEAD", "OPTIONS"}):
                out.append((method, re.sub(r"\{[^}]+\}", "r", route.path)))
    return out


def test_every_admin_route_refuses_tenant_keys_wrong_keys_and_no_key(tc: TestClient) -> None:
    routes = _admin_routes(tc)
    assert len(routes) >= 6, routes  # replicas (list, add, patch, delete), load, router
    for method, path in routes:
        body = {"name": "x", "url": "http://127.0.0.1:1", "pool": "interactive"} if method == "POST" else None
        for key, status, kind in (
            (KEY_A, 403, "permission_error"),
            ("sk-not-a-key-0123456789abcdef", 401, "authentication_error"),
            (None, 401, "authentication_error"),
        ):
            r = tc.request(method, path, headers=_h(key), json=body)
            assert r.status_code == status, (method, path, key, r.status_code, r.text)
            assert _openai_error(r)["type"] == kind
        # And the admin key gets past auth (whatever the route then says of this body).
        r = tc.request(method, path, headers=_h(KEY_ADMIN), json=body)
        assert r.status_code not in (401, 403), (method, path, r.text)


def test_a_tenant_reaches_none_of_another_tenants_resources(tc: TestClient) -> None:
    """Files, their content, batches, jobs, and their outputs: each answers another tenant
    exactly as it answers an id that does not exist (no oracle for guessing ids), and lists
    never show them."""
    up = tc.post(
        "/v1/files",
        files={"file": ("b.jsonl", BATCH_LINE + b"\n")},
        data={"purpose": "batch"},
        headers=_h(KEY_A),
    )
    assert up.status_code == 200, up.text
    batch_file = up.json()["id"]
    ds = tc.post(
        "/v1/files", files={"file": ("d.jsonl", DATASET)}, data={"purpose": "user_data"}, headers=_h(KEY_A)
    ).json()["id"]
    batch = tc.post(
        "/v1/batches",
        json={"input_file_id": batch_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=_h(KEY_A),
    )
    assert batch.status_code == 200, batch.text
    job = tc.post(
        "/v1/jobs",
        json={"kind": "eval", "input_file_id": ds, "model": "tiny", "options": {"scorer": "exact"}},
        headers=_h(KEY_A),
    )
    assert job.status_code == 200, job.text
    batch_id, job_id = batch.json()["id"], job.json()["id"]

    probes: list[tuple[str, str, dict[str, Any] | None, str]] = [
        ("GET", "/v1/files/{}", None, batch_file),
        ("GET", "/v1/files/{}/content", None, batch_file),
        ("DELETE", "/v1/files/{}", None, batch_file),
        ("GET", "/v1/batches/{}", None, batch_id),
        ("POST", "/v1/batches/{}/cancel", None, batch_id),
        ("GET", "/v1/jobs/{}", None, job_id),
        ("POST", "/v1/jobs/{}/cancel", None, job_id),
        (
            "POST",
            "/v1/batches",
            {"input_file_id": "{}", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            batch_file,
        ),
        ("POST", "/v1/jobs", {"kind": "eval", "input_file_id": "{}", "model": "tiny"}, ds),
    ]
    for method, path, body, real_id in probes:

        def call(rid: str, method: str = method, path: str = path, body: Any = body) -> Any:
            filled = json.loads(json.dumps(body).replace("{}", rid)) if body else None
            return tc.request(method, path.format(rid), headers=_h(KEY_B), json=filled)

        theirs = call(real_id)
        unknown = call(real_id[:-4] + "zzzz")
        assert theirs.status_code == unknown.status_code == 404, (method, path, theirs.text)
        a, u = _openai_error(theirs), _openai_error(unknown)
        assert (a["type"], a["code"], a["param"]) == (u["type"], u["code"], u["param"])
        assert a["message"].replace(real_id, "ID") == u["message"].replace(real_id[:-4] + "zzzz", "ID")

    for path in ("/v1/files", "/v1/batches", "/v1/jobs"):
        assert tc.get(path, headers=_h(KEY_B)).json()["data"] == [], path
        assert tc.get(path, headers=_h(KEY_A)).json()["data"], path
    # Everything is still there for its owner.
    assert tc.get(f"/v1/files/{batch_file}/content", headers=_h(KEY_A)).status_code == 200
    assert tc.get(f"/v1/batches/{batch_id}", headers=_h(KEY_A)).json()["status"] != "cancelling"

    # Models: another tenant's adapter is an unknown model, in the list and by name.
    ids_b = {m["id"] for m in tc.get("/v1/models", headers=_h(KEY_B)).json()["data"]}
    ids_a = {m["id"] for m in tc.get("/v1/models", headers=_h(KEY_A)).json()["data"]}
    assert "a-only" in ids_a and "a-only" not in ids_b
    theirs = tc.get("/v1/models/a-only", headers=_h(KEY_B))
    unknown = tc.get("/v1/models/b-never", headers=_h(KEY_B))
    assert theirs.status_code == unknown.status_code == 404
    assert _openai_error(theirs)["code"] == _openai_error(unknown)["code"]


def test_keys_are_held_only_as_hashes() -> None:
    """The store keeps SHA-256 hashes and looks a presented key up by its hash: the timing of a
    lookup depends on the hash, which says nothing usable about the key (no byte-by-byte
    comparison of secrets)."""
    keys = KeyStore()
    keys.add_key(KEY_A, Principal("tenant-a", frozenset({"*"})))
    state = repr(vars(keys))
    assert KEY_A not in state and "sha256:" in state
    assert keys.lookup(KEY_A) is not None and keys.lookup(KEY_A[:-1] + "x") is None
