"""The gateway skeleton: health, metrics, auth and error shapes."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.testclient import TestClient

from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.api.deps import AdminDep, PrincipalDep
from tidal.defaults import DEFAULT_FLEET_PATH
from tidal.fleet import load_fleet
from tidal.settings import Settings


def _client() -> TestClient:
    keys = KeyStore()
    keys.add_key("user-key", Principal("acme", frozenset({"chat"})))
    keys.add_key("admin-key", Principal("ops", frozenset({"*"}), admin=True))
    app = create_app(load_fleet(DEFAULT_FLEET_PATH), Settings(_env_file=None), keys=keys)  # type: ignore[call-arg]
    probe = APIRouter()

    @probe.get("/probe/user")
    async def user(principal: PrincipalDep) -> dict[str, str]:
        return {"tenant": principal.tenant}

    @probe.get("/probe/admin")
    async def admin(principal: AdminDep) -> dict[str, str]:
        return {"tenant": principal.tenant}

    app.include_router(probe)
    return TestClient(app)


def test_healthz_and_metrics() -> None:
    c = _client()
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/metrics").status_code == 200


def test_missing_and_bad_keys_get_openai_shaped_401() -> None:
    c = _client()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        r = c.get("/probe/user", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert c.get("/probe/user", headers={"Authorization": "Bearer user-key"}).json() == {"tenant": "acme"}


def test_admin_endpoints_need_an_admin_key() -> None:
    c = _client()
    r = c.get("/probe/admin", headers={"Authorization": "Bearer user-key"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert c.get("/probe/admin", headers={"Authorization": "Bearer admin-key"}).status_code == 200


def test_unknown_route_is_openai_shaped_404() -> None:
    r = _client().get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
